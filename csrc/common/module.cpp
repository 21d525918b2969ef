// The Python module object of flashllm_ext._C. Importing it runs the static TORCH_LIBRARY_IMPL registrations of
// every kernel linked into the library; its functions let tests and benchmarks see and choose the CPU code path and
// turn the CUDA glue's host-side data checks on or off (common/kernel_checks.h).
#include <Python.h>

#include <iterator>
#include <set>
#include <stdexcept>
#include <string>

#include "common/cpu_isa.h"
#include "common/kernel_checks.h"

namespace {

PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(flashllm::cpu_isa_name(flashllm::active_cpu_isa()));
}

PyObject* detected_cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(flashllm::cpu_isa_name(flashllm::detected_cpu_isa()));
}

PyObject* cpu_isas(PyObject*, PyObject*) {
  PyObject* names = PyTuple_New(std::size(flashllm::kCpuIsas));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < std::size(flashllm::kCpuIsas); ++i) {
    PyObject* name = PyUnicode_FromString(flashllm::cpu_isa_name(flashllm::kCpuIsas[i]));
    if (name == nullptr) {
      Py_DECREF(names);
      return nullptr;
    }
    PyTuple_SET_ITEM(names, i, name);
  }
  return names;
}

PyObject* set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  try {
    flashllm::force_cpu_isa(flashllm::cpu_isa_from_name(name));
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* isa_for_features(PyObject*, PyObject* arg) {
  PyObject* iterator = PyObject_GetIter(arg);
  if (iterator == nullptr) return nullptr;
  std::set<std::string> features;
  while (PyObject* item = PyIter_Next(iterator)) {
    const char* name = PyUnicode_AsUTF8(item);
    if (name != nullptr) features.insert(name);
    Py_DECREF(item);
    if (name == nullptr) break;
  }
  Py_DECREF(iterator);
  if (PyErr_Occurred()) return nullptr;
  return PyUnicode_FromString(flashllm::cpu_isa_name(flashllm::isa_for_features(features)));
}

PyObject* kernel_checks(PyObject*, PyObject*) {
  return PyBool_FromLong(flashllm::kernel_checks_enabled());
}

PyObject* set_kernel_checks(PyObject*, PyObject* arg) {
  const int enabled = PyObject_IsTrue(arg);
  if (enabled < 0) return nullptr;
  flashllm::set_kernel_checks(enabled != 0);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS, "The CPU instruction set the kernels use now."},
    {"detected_cpu_isa", detected_cpu_isa, METH_NOARGS, "The best CPU instruction set available."},
    {"cpu_isas", cpu_isas, METH_NOARGS, "Every CPU instruction set the kernels know, lowest first."},
    {"set_cpu_isa", set_cpu_isa, METH_O, "Use a lower instruction set (one of cpu_isas(), up to detected_cpu_isa())."},
    {"isa_for_features", isa_for_features, METH_O,
     "The instruction set chosen for a CPU with these features (GCC target names, e.g. 'avx2', 'fma')."},
    {"kernel_checks", kernel_checks, METH_NOARGS, "Whether the CUDA ops check their data on the host (synchronising)."},
    {"set_kernel_checks", set_kernel_checks, METH_O,
     "Turn the CUDA ops' host-side data checks on (debugging; synchronises, not for CUDA graphs) or off."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "flashllm_ext native kernels", -1, methods};
  return PyModule_Create(&module);
}
