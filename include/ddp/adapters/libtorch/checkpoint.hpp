#pragma once
/// \file ddp::load_module: a checkpoint that ddp::save wrote, loaded into a plain torch::nn::Module (no
/// data_parallel, one process), e.g. for inference. Parameters (trainable and frozen) and buffers are matched by
/// the names named_parameters() and named_buffers() give (ddp saves them under those names, without a "module."
/// prefix), strictly as PyTorch's load_state_dict(strict=True); "optim.*" entries are ignored.

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/checkpoint/safetensors.hpp>
#include <ddp/checkpoint/state.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

namespace ddp {

/// Loads the file at `path` (written by ddp::save, or any safetensors file of these names) into `module`'s
/// parameters and buffers; verifies ddp's checksum first. Throws ddp::io_error for an unreadable file and
/// ddp::mismatch_error naming a parameter or buffer the file lacks, a tensor of another shape or dtype, or a tensor
/// the module lacks. Returns the file's metadata.
inline checkpoint_metadata load_module(const std::filesystem::path& path, torch::nn::Module& module) {
  const auto in = safetensors::reader::open(path);
  in.verify_checksum();
  const std::string file = "'" + path.string() + "'";
  std::vector<std::string> used;
  auto fill = [&](const std::string& name, torch::Tensor& t, const char* what) {
    const auto* e = in.find(name);
    if (!e)
      throw mismatch_error("load_module: " + file + " has no tensor '" + name + "', which the module's " + what +
                           " name; load a checkpoint of this model (ddp::save of the same architecture; files "
                           "written before ddp saved buffers and frozen parameters lack them)");
    std::vector<std::size_t> shape;
    for (const auto d : t.sizes()) shape.push_back(static_cast<std::size_t>(d));
    const auto type = detail::libtorch::dtype_of(t.scalar_type());
    if (!type || *type != e->type || shape != e->shape)
      throw mismatch_error("load_module: tensor '" + name + "' of " + file + " is " + std::string(to_string(e->type)) +
                           " of another shape or type than the module's (" + detail::libtorch::describe_shape(t) + " of " +
                           std::string(c10::toString(t.scalar_type())) + "); build the model the checkpoint was saved from");
    torch::NoGradGuard no_grad;
    torch::Tensor staging = torch::empty(t.sizes(), t.options().device(torch::kCPU).requires_grad(false));
    in.read(*e, 0, {static_cast<std::byte*>(staging.data_ptr()), e->bytes()});
    t.copy_(staging);
    used.push_back(name);
  };
  for (auto& item : module.named_parameters(/*recurse=*/true)) fill(item.key(), item.value(), "parameters");
  for (auto& item : module.named_buffers(/*recurse=*/true)) fill(item.key(), item.value(), "buffers");
  for (const auto& e : in.entries())
    if (!e.name.starts_with("optim.") && std::find(used.begin(), used.end(), e.name) == used.end())
      throw mismatch_error("load_module: " + file + " holds tensor '" + e.name + "', which the module does not have; "
                           "build the model the checkpoint was saved from");
  return in.metadata();
}

}  // namespace ddp
