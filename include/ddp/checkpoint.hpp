#pragma once
/// \file Checkpoints: full (ddp::save / ddp::load, one safetensors file PyTorch reads) and sharded
/// (ddp::save_sharded / ddp::load_sharded, a part per rank plus a manifest), and the safetensors
/// reader and writer underneath. Needs nlohmann_json, which the ddp::ddp target links.

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/checkpoint/safetensors.hpp>
#include <ddp/checkpoint/sharded.hpp>
#include <ddp/checkpoint/state.hpp>
