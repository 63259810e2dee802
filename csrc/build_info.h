// What the extension was built against and what it runs with, for diagnostics.
#pragma once

#include <cstdint>
#include <vector>

namespace convbias {

// {CUDNN_VERSION at build time, cudnnGetVersion() at run time, CUDNN_FRONTEND_VERSION}.
std::vector<int64_t> cudnn_versions();

} // namespace convbias
