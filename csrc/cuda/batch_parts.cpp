#include "cuda/batch_parts.h"

#include "cuda/forward_setup.h"

#include <limits>
#include <sstream>

namespace convbias::cuda {

std::optional<int64_t> batch_part_size(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel) {
  constexpr int64_t limit = std::numeric_limits<int32_t>::max();
  const int64_t batch = input.dim() > 0 ? input.size(0) : 0;
  if (batch <= 1 || weight.numel() > limit || (input.numel() <= limit && output_numel <= limit) ||
      aten_only_setting_reason(input, weight)) {
    return std::nullopt;
  }
  const int64_t per_sample = std::max(input.numel(), output_numel) / batch;
  if (per_sample > limit) {
    return std::nullopt;
  }
  const int64_t most = limit / per_sample; // samples in a part that fits
  const int64_t parts = batch_part_count(batch, most);
  return (batch + parts - 1) / parts; // the part size that spreads the batch evenly over that many parts
}

std::string batch_parts_note(int64_t batch, int64_t part) {
  std::ostringstream note;
  note << "the batch of " << batch << " runs in " << batch_part_count(batch, part) << " parts of at most " << part
       << " samples (the call's input or output passes 2^31 - 1 elements, the limit of cuDNN's 32-bit indexing); "
          "this describes the first part";
  return note.str();
}

} // namespace convbias::cuda
