#pragma once
/// \file Output of a training job: ddp::logger (rank 0 speaks for the job) and ddp::progress_bar
/// (step, loss, samples/s and ETA, drawn by rank 0).

#include <ddp/launch/log.hpp>
#include <ddp/launch/progress.hpp>
