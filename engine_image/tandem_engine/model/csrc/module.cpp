// The native CPU kernels as one Python module: native.py compiles the csrc files in the
// order of its _SOURCES, this one last.

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)");
  m.attr("vector_bits") = kVectorBits;
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "A prefill chunk's causal attention over a paged KV cache (CPU, float32)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("blocks"),
        py::arg("start"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("int4_matvec", &int4_matvec,
        "x [M, K] float32 times int4 weights in groups of 32 (CPU); precise: activations "
        "in two int8 terms",
        py::arg("x"), py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("n"),
        py::arg("precise") = false);
  m.def("int8_matvec", &int8_matvec,
        "x [M, K] float32 times int8 rows (CPU); precise: activations in two int8 terms",
        py::arg("x"), py::arg("weight"), py::arg("scales"), py::arg("precise") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows (CPU)");
  py::class_<DecodeStack>(m, "DecodeStack",
                          "A Llama-family decoder stack's decode step in one call (CPU)")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, torch::Tensor,
                    std::vector<torch::Tensor>, int64_t, int64_t, int64_t, int64_t, double>())
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("logits", &DecodeStack::logits, py::call_guard<py::gil_scoped_release>());
}
