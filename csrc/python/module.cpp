// The Python module torch_convbias._C: Python entry points only. The operators are registered by
// libtorch_convbias.so (loaded first by torch_convbias/__init__.py) and reached through the dispatcher
// (csrc/convbias.h), so this module does not link that library; everything else goes through torch.ops.
//
// _forward_eager(input, weight, bias, stride, padding, dilation, groups[, activation, negative_slope]): convbias::forward through the C++
// dispatcher, for ConvBias2d's eager calls. A call through torch.ops matches its Python arguments against the
// schema generically and calls the op boxed, ~5 us of host time per call (measured: 8.9 us for a tiny CPU
// convolution against 3.4 us for F.conv2d), which is most of a small layer's cost on a GPU. This entry takes
// only plain tensors (torch.Tensor or nn.Parameter, exactly) and plain ints, and returns NotImplemented for
// anything else (tensor subclasses, __torch_function__ overrides, SymInts), so the caller falls back to
// torch.ops. Dispatch itself is the same: autograd, autocast, tracing and Python dispatch modes see the call.
#include <Python.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <optional>

#include "convbias.h"

namespace {

// A pair of Python ints (tuple or list of 2) into `out`; false for anything else.
bool int_pair(PyObject* obj, std::array<int64_t, 2>& out) {
  if (!(PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) || PySequence_Fast_GET_SIZE(obj) != 2) {
    return false;
  }
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (int i = 0; i < 2; ++i) {
    if (!PyLong_CheckExact(items[i])) {
      return false;
    }
    int overflow = 0;
    out[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0) {
      return false;
    }
  }
  return true;
}

PyObject* forward_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if ((nargs != 7 && nargs != 9) || !THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) ||
      !(args[2] == Py_None || THPVariable_CheckExact(args[2])) || !PyLong_CheckExact(args[6])) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  // Optional: activation (a str) and negative_slope (a float).
  const char* activation = "identity";
  double negative_slope = 0.01;
  if (nargs == 9) {
    if (!PyUnicode_CheckExact(args[7]) || !PyFloat_CheckExact(args[8])) {
      Py_RETURN_NOTIMPLEMENTED;
    }
    activation = PyUnicode_AsUTF8(args[7]);
    if (activation == nullptr) {
      return nullptr;
    }
    negative_slope = PyFloat_AS_DOUBLE(args[8]);
  }
  std::array<int64_t, 2> stride{}, padding{}, dilation{};
  if (!int_pair(args[3], stride) || !int_pair(args[4], padding) || !int_pair(args[5], dilation)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int overflow = 0;
  const int64_t groups = PyLong_AsLongLongAndOverflow(args[6], &overflow);
  if (overflow != 0) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  const at::Tensor& input = THPVariable_Unpack(args[0]);
  const at::Tensor& weight = THPVariable_Unpack(args[1]);
  std::optional<at::Tensor> bias;
  if (args[2] != Py_None) {
    bias = THPVariable_Unpack(args[2]);
  }
  at::Tensor output;
  {
    // As torch's own bindings: other Python threads run while the op does; kernels that need Python (Python
    // dispatch modes, hooks) take the GIL back themselves.
    pybind11::gil_scoped_release no_gil;
    output = convbias::forward(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
  }
  return THPVariable_Wrap(std::move(output));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_forward_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forward_eager)), METH_FASTCALL,
     "convbias::forward for plain tensors and ints, NotImplemented otherwise (the caller then uses torch.ops)."},
    {nullptr, nullptr, 0, nullptr},
};

} // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C", // name
      "torch_convbias native library: registers the torch.ops.convbias operators.", // doc
      -1, // no per-module state
      methods,
  };
  return PyModule_Create(&module_def);
}
}
