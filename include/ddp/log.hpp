#pragma once
/// \file Output of a training job: ddp::logger (rank 0 speaks for the job) and ddp::progress_bar
/// (step, loss, samples/s and ETA, drawn by rank 0).

#include <ddp/log/logger.hpp>
#include <ddp/log/progress_bar.hpp>
