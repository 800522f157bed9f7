#pragma once
/// \file What a training or test batch yields on one rank, whatever the model.

#include <cstddef>

namespace example {

/// Loss sum and correct predictions of one batch.
struct batch_result {
  double loss_sum = 0;      ///< sum of per-sample cross-entropy losses
  std::size_t correct = 0;  ///< samples whose arg-max logit is the label
};

}  // namespace example
