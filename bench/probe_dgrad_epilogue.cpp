// Probe for issue 14: does cuDNN build (and how fast does it run) the input gradient of a convolution with the
// derivative of the previous layer's ReLU as its epilogue, dz = conv_dgrad(dy, w) * (y > 0), optionally with the
// bias-gradient reduction db = sum_{N,H,W} dz in the same graph? Built with torch.utils.cpp_extension by
// bench/probe_dgrad_epilogue.py, which times it against the route the extension runs today. Not part of the library.
#include <ATen/cudnn/Handle.h>
#include <torch/extension.h>

#include <cudnn_frontend.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace fe = cudnn_frontend;

namespace {

constexpr int64_t kDY = 1, kW = 2, kY = 3, kOut = 4, kDB = 5;

struct Probe {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t variant = 0;
  std::vector<int64_t> built; // plan indices that built
};

std::vector<std::shared_ptr<Probe>>& probes() {
  static std::vector<std::shared_ptr<Probe>> all;
  return all;
}

fe::DataType_t dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return fe::DataType_t::HALF;
    case at::kBFloat16: return fe::DataType_t::BFLOAT16;
    case at::kFloat: return fe::DataType_t::FLOAT;
    default: TORCH_CHECK(false, "probe: float16, bfloat16 or float32 tensors only");
  }
}

std::vector<int64_t> vec(at::IntArrayRef a) {
  return {a.begin(), a.end()};
}

} // namespace

// Builds the graph (variant 0: dgrad alone; 1: dgrad -> RELU_BWD with y; 2: 1 + the ADD reduction to db) and every
// plan the heuristics (A, FALLBACK) offer that builds under the numeric filters (TF32 excluded unless allow_tf32 for
// float32; reduced-precision reductions always excluded). Returns (probe id, JSON of the attempt: failure or the
// plans with their names and workspace sizes); -1 when the graph does not build.
std::tuple<int64_t, std::string> build(
    const at::Tensor& dy, const at::Tensor& w, const at::Tensor& y, int64_t stride, int64_t padding, int64_t variant,
    bool allow_tf32) {
  auto probe = std::make_shared<Probe>();
  probe->variant = variant;
  auto g = std::make_shared<fe::graph::Graph>();
  const auto io = dtype_of(dy);
  g->set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  auto tensor = [&](const char* name, int64_t uid, const at::Tensor& t) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim(vec(t.sizes()))
                         .set_stride(vec(t.strides()))
                         .set_data_type(io));
  };
  auto DY = tensor("dy", kDY, dy);
  auto W = tensor("w", kW, w);
  auto DX = g->conv_dgrad(
      DY, W,
      fe::graph::Conv_dgrad_attributes().set_name("dgrad").set_padding({padding, padding}).set_stride({stride, stride})
          .set_dilation({1, 1}));
  DX->set_dim(vec(y.sizes())).set_stride(vec(y.strides()));
  if (variant == 0) {
    DX->set_output(true).set_uid(kOut).set_data_type(io);
  } else {
    auto Y = tensor("y", kY, y);
    auto DZ = g->pointwise(
        DX, Y,
        fe::graph::Pointwise_attributes().set_name("drelu").set_mode(fe::PointwiseMode_t::RELU_BWD)
            .set_compute_data_type(fe::DataType_t::FLOAT));
    DZ->set_output(true).set_uid(kOut).set_data_type(io).set_dim(vec(y.sizes())).set_stride(vec(y.strides()));
    if (variant == 2) {
      const int64_t c = y.size(1);
      auto DB = g->reduction(
          DZ, fe::graph::Reduction_attributes().set_name("dbias").set_mode(fe::ReductionMode_t::ADD)
                  .set_compute_data_type(fe::DataType_t::FLOAT));
      DB->set_output(true).set_uid(kDB).set_data_type(fe::DataType_t::FLOAT).set_dim({1, c, 1, 1}).set_stride({c, 1, c, c});
    }
  }
  nlohmann::json out;
  auto fail = [&](const std::string& step, fe::error_t status) {
    out["failure"] = step + ": " + status.get_message();
    return std::make_tuple(int64_t{-1}, out.dump());
  };
  auto handle = at::native::getCudnnHandle();
  if (auto s = g->validate(); s.is_bad()) return fail("validate", s);
  if (auto s = g->build_operation_graph(handle); s.is_bad()) return fail("build_operation_graph", s);
  if (auto s = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); s.is_bad()) {
    return fail("create_execution_plans", s);
  }
  std::vector<fe::NumericalNote_t> excluded{fe::NumericalNote_t::REDUCED_PRECISION_REDUCTION};
  if (io == fe::DataType_t::FLOAT && !allow_tf32) {
    excluded.push_back(fe::NumericalNote_t::TENSOR_CORE);
    excluded.push_back(fe::NumericalNote_t::DOWN_CONVERT_INPUTS);
  }
  g->deselect_numeric_notes(excluded);
  const int64_t count = g->get_execution_plan_count();
  out["offered"] = count;
  out["plans"] = nlohmann::json::array();
  for (int64_t i = 0; i < count; ++i) {
    std::string name;
    (void)g->get_plan_name_at_index(i, name);
    auto s = g->build_plan_at_index(i);
    int64_t workspace = 0;
    if (s.is_good()) {
      (void)g->get_workspace_size_plan_at_index(i, workspace);
      probe->built.push_back(i);
    }
    out["plans"].push_back({{"index", i}, {"name", name}, {"built", s.is_good()},
                            {"error", s.is_good() ? "" : s.get_message()}, {"workspace", workspace}});
  }
  probe->graph = g;
  probes().push_back(probe);
  return {static_cast<int64_t>(probes().size()) - 1, out.dump()};
}

// Runs plan `index` of probe `id` on the current stream: writes out (dx or dz) and, for variant 2, db (zeroed
// first: the reduction's output is not assumed to start at zero).
void execute(
    int64_t id, int64_t index, const at::Tensor& dy, const at::Tensor& w, const at::Tensor& y, const at::Tensor& out,
    const at::Tensor& db) {
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(probes().size()), "probe: no probe ", id);
  Probe& p = *probes()[id];
  int64_t bytes = 0;
  (void)p.graph->get_workspace_size_plan_at_index(index, bytes);
  auto workspace = at::empty({std::max<int64_t>(bytes, 1)}, dy.options().dtype(at::kByte));
  std::unordered_map<int64_t, void*> pack{{kDY, dy.data_ptr()}, {kW, w.data_ptr()}, {kOut, out.data_ptr()}};
  if (p.variant >= 1) pack[kY] = y.data_ptr();
  if (p.variant == 2) {
    db.zero_();
    pack[kDB] = db.data_ptr();
  }
  auto handle = at::native::getCudnnHandle(); // bound to the current stream by ATen
  auto s = p.graph->execute_plan_at_index(handle, pack, workspace.data_ptr(), index);
  TORCH_CHECK(s.is_good(), "probe: executing plan ", index, ": ", s.get_message());
}

std::vector<int64_t> built_plans(int64_t id) {
  return probes().at(id)->built;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build", &build);
  m.def("execute", &execute);
  m.def("built_plans", &built_plans);
}
