// Makes the library importable as the Python module torch_convbias._C. Importing it runs the static
// TORCH_LIBRARY registrations; the module itself exposes nothing: everything is reached through torch.ops.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C", // name
      "torch_convbias native library: registers the torch.ops.convbias operators.", // doc
      -1, // no per-module state
      nullptr, // no methods
  };
  return PyModule_Create(&module_def);
}
}
