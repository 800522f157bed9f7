"""What the bench drivers name a machine by (its CPU model, logical CPUs and platform), and how they hand out a
report."""
import os
import platform


def describe():
    """'Intel(R) Xeon(R) ..., 16 logical CPUs, Linux-...'."""
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return "%s, %d logical CPUs, %s" % (model or platform.processor(), os.cpu_count(), platform.platform())


def publish(lines, out):
    """Prints a report's lines and, when `out` names a file, writes them there."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
