// A Llama-family model's decode step in C++ (models/llama.py's decode program): every layer's ops,
// in the order the layers' Python steps call them, with no Python between them.
//
// The Python decode program (one function per layer, its weights and ops bound once) still paid per
// layer about 20 us of Python and of the dispatches of its eight ops (measured on SmolLM2's 30 layers
// made 64 wide, where the kernels cost next to nothing: 0.83 ms a step in all). Here the layers are
// registered once (their norms' weights, each linear layer's kernel op with its weight arguments, the
// attention's caches and sizes) and `run` calls the same ops through the dispatcher's typed and boxed
// handles: the same kernels in the same order, so the same numbers bit for bit.
//
// A linear layer is any op of the form op(x, <its weight arguments, the bias among them>): `add_linear`
// takes the op's name, its tensor and int arguments in order, and a pattern of 'T' (the next tensor),
// 'I' (the next int), 'D' (the activations' dtype) and 'N' (None) saying where each goes after x. Layers
// whose linear layers have no such kernel (other quantization methods, tensor parallelism), q/k norms
// (Qwen3) or other row counts keep the Python program.
//
// w8a8 layers after a norm (qkv_proj, gate_up_proj) take their input quantized by that norm, in one op
// (int8_gemm.cpp's w8a8_rms_norm_quant, PPL.LLM's fusion): their op is op(q, scales, <weight arguments>),
// and the layer's quant_group (the activation group size; -1: no fusion) says to call the norm that way.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

c10::OperatorHandle find_op(const std::string& name) {
  const auto sep = name.find('.');  // "ns::op" or "ns::op.overload"
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.substr(0, sep).c_str(), sep == std::string::npos ? "" : name.substr(sep + 1).c_str());
}

struct LinearCall {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // everything after the input
  size_t inputs = 1;               // x, or (a layer fed by its norm's quantize) q and scales

  Tensor operator()(const Tensor& x) const { return call({x}); }
  Tensor operator()(const std::tuple<Tensor, Tensor>& quantized) const { return call({std::get<0>(quantized), std::get<1>(quantized)}); }

  Tensor call(std::initializer_list<Tensor> inputs) const {
    torch::jit::Stack stack;
    stack.reserve(args.size() + inputs.size());
    stack.insert(stack.end(), inputs.begin(), inputs.end());
    stack.insert(stack.end(), args.begin(), args.end());
    op.callBoxed(stack);
    return stack[0].toTensor();
  }
};

struct Layer {
  Tensor norm_1, norm_2;
  double eps_1, eps_2;
  int64_t qkv, o_proj, gate_up, down;  // indices into the linear calls
  int64_t num_heads, num_kv_heads;
  Tensor k_cache, v_cache;
  OptTensor k_scale, v_scale;
  int64_t window;
  double scale;
  int64_t quant_group;  // >= 0: the norms quantize qkv_proj's and gate_up_proj's input in groups of this size
};

struct DecodeProgram : torch::CustomClassHolder {
  std::vector<LinearCall> linears;
  std::vector<Layer> layers;
  // The ops' C++ signatures as they are registered (pointwise.cpp, paged_attention.cpp).
  using RmsNorm = Tensor(const Tensor&, const Tensor&, double);
  using AddRmsNorm = Tensor(Tensor, const Tensor&, const Tensor&, double);
  using SiluAndMul = Tensor(const Tensor&);
  using NormQuant = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, double, int64_t);
  using Attention = Tensor(Tensor, int64_t, int64_t, const Tensor&, const Tensor&, Tensor, Tensor, const OptTensor&, const OptTensor&,
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double, const OptTensor&, const OptTensor&);
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op("tokenmill_cpu::rms_norm").typed<RmsNorm>();
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = find_op("tokenmill_cpu::add_rms_norm").typed<AddRmsNorm>();
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = find_op("tokenmill_cpu::silu_and_mul").typed<SiluAndMul>();
  c10::TypedOperatorHandle<NormQuant> norm_quant = find_op("tokenmill_cpu::w8a8_rms_norm_quant").typed<NormQuant>();
  c10::TypedOperatorHandle<Attention> attention = find_op("tokenmill_cpu::decode_attention_block").typed<Attention>();

  // Registers a linear layer's kernel call; returns its index for add_layer.
  int64_t add_linear(const std::string& op, const std::vector<Tensor>& tensors, const std::vector<int64_t>& ints,
                     const std::string& pattern, c10::ScalarType dtype) {
    LinearCall call{find_op(op), {}};
    size_t t = 0, i = 0;
    for (const char c : pattern) {
      if (c == 'T') {
        TORCH_CHECK(t < tensors.size(), "DecodeProgram.add_linear: the pattern asks for more tensors than given");
        call.args.emplace_back(tensors[t++]);
      } else if (c == 'I') {
        TORCH_CHECK(i < ints.size(), "DecodeProgram.add_linear: the pattern asks for more ints than given");
        call.args.emplace_back(ints[i++]);
      } else if (c == 'D') {
        call.args.emplace_back(dtype);
      } else if (c == 'N') {
        call.args.emplace_back(c10::IValue());
      } else {
        TORCH_CHECK(false, "DecodeProgram.add_linear: unknown pattern character '", c, "' (T, I, D or N)");
      }
    }
    TORCH_CHECK(t == tensors.size() && i == ints.size(), "DecodeProgram.add_linear: arguments left over after the pattern");
    const size_t arguments = call.op.schema().arguments().size();
    call.inputs = arguments - std::min(call.args.size(), arguments);  // what comes before the pattern's arguments
    TORCH_CHECK(call.inputs == 1 || call.inputs == 2, "DecodeProgram.add_linear: ", op, " takes ", arguments,
                " arguments, the pattern gives ", call.args.size(), " after its input (x, or q and scales)");
    linears.push_back(std::move(call));
    return static_cast<int64_t>(linears.size()) - 1;
  }

  void add_layer(const Tensor& norm_1, double eps_1, const Tensor& norm_2, double eps_2, int64_t qkv, int64_t o_proj, int64_t gate_up,
                 int64_t down, int64_t num_heads, int64_t num_kv_heads, const Tensor& k_cache, const Tensor& v_cache,
                 const OptTensor& k_scale, const OptTensor& v_scale, int64_t window, double scale, int64_t quant_group) {
    for (const int64_t index : {qkv, o_proj, gate_up, down})
      TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears.size()), "DecodeProgram.add_layer: no linear call ", index);
    for (const int64_t index : {qkv, gate_up})
      TORCH_CHECK((linears[index].inputs == 2) == (quant_group >= 0),
                  "DecodeProgram.add_layer: qkv_proj and gate_up_proj must take quantized input exactly when quant_group >= 0");
    layers.push_back({norm_1, norm_2, eps_1, eps_2, qkv, o_proj, gate_up, down, num_heads, num_kv_heads, k_cache, v_cache, k_scale,
                      v_scale, window, scale, quant_group});
  }

  // How many layers quantize qkv_proj's and gate_up_proj's input in their norms (tests).
  int64_t quantizing_layers() const {
    return std::count_if(layers.begin(), layers.end(), [](const Layer& layer) { return layer.quant_group >= 0; });
  }

  // The embeddings -> (the last layer's output, the residual stream before it), as the layers' Python steps
  // (the first layer's input is the residual stream itself). tree_start / tree_mask: a token tree's rows
  // (AttentionGroup's), or None.
  std::tuple<Tensor, Tensor> run(Tensor hidden, const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping, const Tensor& token_rows,
                                 const Tensor& block_table, const Tensor& positions, const OptTensor& tree_start,
                                 const OptTensor& tree_mask) {
    Tensor residual;
    for (Layer& layer : layers) {
      const bool first = !residual.defined();
      if (first) residual = hidden;
      Tensor qkv;
      if (layer.quant_group >= 0) {
        qkv = linears[layer.qkv](norm_quant.call(hidden, first ? OptTensor() : OptTensor(residual), layer.norm_1, layer.eps_1,
                                                 layer.quant_group));
      } else {
        qkv = linears[layer.qkv](first ? rms_norm.call(hidden, layer.norm_1, layer.eps_1)
                                       : add_rms_norm.call(residual, hidden, layer.norm_1, layer.eps_1));
      }
      const Tensor out = attention.call(qkv, layer.num_heads, layer.num_kv_heads, cos, sin, layer.k_cache, layer.v_cache, layer.k_scale,
                                        layer.v_scale, slot_mapping, token_rows, block_table, positions, layer.window, layer.scale,
                                        tree_start, tree_mask);
      const Tensor attn_out = linears[layer.o_proj](out);
      const Tensor gate_up = layer.quant_group >= 0
                                 ? linears[layer.gate_up](norm_quant.call(attn_out, residual, layer.norm_2, layer.eps_2, layer.quant_group))
                                 : linears[layer.gate_up](add_rms_norm.call(residual, attn_out, layer.norm_2, layer.eps_2));
      hidden = linears[layer.down](silu_and_mul.call(gate_up));
    }
    return {hidden, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.class_<DecodeProgram>("DecodeProgram")
      .def(torch::init<>())
      .def("add_linear", &DecodeProgram::add_linear)
      .def("add_layer", &DecodeProgram::add_layer)
      .def("quantizing_layers", &DecodeProgram::quantizing_layers)
      .def("run", &DecodeProgram::run);
}
