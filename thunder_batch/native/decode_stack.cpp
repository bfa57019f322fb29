// A decode-only step's layers in one host call, where every layer's program is the one `decode_block` op: the
// layers' arguments that stay (norm weights, the linears' packed copies, caches, mask kind, eps, scale) are bound
// once; a step passes x and what all layers share (cos, sin, the cache rows, the masks). The same calls, in the
// same order, as the layers' programs make one by one: the same bits, without ~30 us of Python per layer.
// The packed copies are a snapshot of their weights: `run` answers None once any of those weights changed in
// place (its version counter), and the caller goes back to the programs, which pack again.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

struct Layer {
  at::Tensor norm_1, norm_2, qkv, proj, fc_1, fc_2, mlp_proj, cache_k, cache_v;
  c10::optional<at::Tensor> qkv_bias;
  std::vector<int64_t> out_features;
  int64_t kind;
  double eps_1, eps_2, scale;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;
  std::vector<at::Tensor> sources;  // the weights the packed copies were made from
  std::vector<int64_t> versions;    // their version counters then

  // One layer's `decode_block` arguments but x, cos, sin, rows and masks (the op's order).
  void add_layer(at::Tensor norm_1, at::Tensor norm_2, at::Tensor qkv, c10::optional<at::Tensor> qkv_bias,
                 at::Tensor proj, at::Tensor fc_1, at::Tensor fc_2, at::Tensor mlp_proj,
                 std::vector<int64_t> out_features, at::Tensor cache_k, at::Tensor cache_v, int64_t kind, double eps_1,
                 double eps_2, double scale) {
    TORCH_CHECK(out_features.size() == 4, "DecodeStack: four out_features");
    layers.push_back(Layer{norm_1, norm_2, qkv, proj, fc_1, fc_2, mlp_proj, cache_k, cache_v, qkv_bias,
                           std::move(out_features), kind, eps_1, eps_2, scale});
  }

  void watch(at::Tensor source) {
    versions.push_back(source._version());
    sources.push_back(std::move(source));
  }

  bool current() const {
    for (size_t i = 0; i < sources.size(); ++i)
      if (sources[i]._version() != versions[i]) return false;
    return true;
  }

  // x [B, C] -> the last layer's output [B, C]; None (nothing run) if a watched weight changed.
  c10::optional<at::Tensor> run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor rows, at::Tensor masks) {
    if (!current()) return c10::nullopt;
    for (const Layer& l : layers)
      x = packed::decode_block(x, l.norm_1, l.norm_2, l.qkv, l.qkv_bias, l.proj, l.fc_1, l.fc_2, l.mlp_proj,
                               l.out_features, cos, sin, l.cache_k, l.cache_v, rows, masks, l.kind, l.eps_1, l.eps_2,
                               l.scale);
    return x;
  }
};

// An op (the profiler and the dispatcher see one call): stack->run(x, cos, sin, rows, masks).
c10::optional<at::Tensor> decode_stack(const c10::intrusive_ptr<DecodeStack>& stack, at::Tensor x, at::Tensor cos,
                                       at::Tensor sin, at::Tensor rows, at::Tensor masks) {
  return stack->run(std::move(x), std::move(cos), std::move(sin), std::move(rows), std::move(masks));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("watch", &DecodeStack::watch)
      .def("current", &DecodeStack::current);
  m.def(
      "decode_stack(__torch__.torch.classes.thunder_batch.DecodeStack stack, Tensor x, Tensor cos, Tensor sin, "
      "Tensor rows, Tensor masks) -> Tensor?");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) { m.impl("decode_stack", decode_stack); }
