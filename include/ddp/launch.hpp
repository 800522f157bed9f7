#pragma once
/// \file The launcher API (CMake target ddp::launch): ddp::launch::spawn runs a function in N forked
/// ranks with torchrun's environment, ddp::launch::spawn_program N copies of a program (what the
/// ddp-launch program does).

#include <ddp/launch/spawn.hpp>
