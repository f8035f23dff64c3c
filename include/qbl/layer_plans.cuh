// qbl/layer_plans.cuh -- the layer as two immutable plans, in the manner of CUTLASS's device-level
// operators (can_implement / get_workspace_size / run over an arguments struct):
//
//   qbl::ForwardPlan<X, G, L, Act>   the prologue (amax, quant-blend) and the forward GEMM
//   qbl::BackwardPlan<X, G, L, Act>  the dgrad and wgrad GEMMs, the quant-blend backward and the
//                                    bias gradient, wgrad beside dgrad on a caller's SideStream
//
// Element types: X for x (and grad_x), G for the GEMM (mixed, weight, bias, out and their
// gradients), L for the logits (and grad_logits): one of qbl::SupportedTypes (qbl/types.hpp) --
// one type for all three (float, __nv_bfloat16, __half; G and L default to X), or fp32 x with a
// bf16 or fp16 GEMM and the logits in fp32 or in the GEMM's type, what PyTorch's autocast gives a
// layer, computed as eager computes the reference module under autocast.
//
// Act: the input activation (qbl/activation.cuh; default qbl::Identity, none). With one, `x` is
// the activation's input h and the layer computes Linear(blend(quant(act(h)))) as eager computes
// the reference module fed with F.gelu(h) (or tanh-GELU, ReLU, SiLU): act(h) rounded to X in the
// prologue's both passes, never stored; the backward recomputes it from h, and grad_x is the
// gradient of h. The backward can also recompute `mixed` (BackwardArgs::mixed null), so that a
// training framework keeps only x, the logits and the 8 bytes of stats between the two.
//
// A plan is made once per shape (it plans cuBLASLt for every token count up to max_tokens) and
// holds nothing mutable: every run() takes the caller's workspace of workspace_bytes() and, for a
// backward with wgrad beside dgrad, the caller's SideStream. run() checks its arguments in one
// function (supports() asks the same one) and throws before anything is enqueued; it allocates
// nothing, queries no heuristic, never synchronizes, and can be captured in a CUDA graph. Plans
// are const after construction: run() may be called from several threads and streams at once,
// each call with its own workspace (and side stream).
//
//   qbl::ForwardPlan<float> fwd(in, out, max_tokens);
//   qbl::BackwardPlan<float> bwd(in, out, max_tokens);
//   qbl::SideStream side;                              // one per stream that runs backwards
//   void* ws;  cudaMalloc(&ws, std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
//   qbl::ForwardArgs<float> f;  f.x = d_x;  f.logits = d_l;  f.weight = d_w;  f.bias = d_b;
//   f.out = d_out;  f.mixed = d_mixed;  f.stats = d_stats;  f.tokens = tokens;
//   fwd.run(f, ws, stream);
//   qbl::BackwardArgs<float> b;  b.grad_out = d_g;  b.x = d_x;  b.logits = d_l;  b.weight = d_w;
//   b.mixed = d_mixed;  b.stats = d_stats;  b.tokens = tokens;
//   b.grad_x = d_gx;  b.grad_logits = d_gl;  b.grad_weight = d_gw;  b.grad_bias = d_gb;
//   bwd.run(b, ws, &side, stream);                     // or nullptr: all on stream
#pragma once

#include <qbl/detail/config.cuh>  // first: it stops a non-CUDA compile with one clear error

#include <qbl/detail/checks.hpp>
#include <qbl/detail/handles.hpp>
#include <qbl/error.hpp>
#include <qbl/gemm.cuh>
#include <qbl/options.hpp>
#include <qbl/quant_blend.cuh>
#include <qbl/quant_blend_backward.cuh>
#include <qbl/types.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qbl {

/// Floats in a `stats` buffer: [amax, scale].
inline constexpr std::int64_t stats_floats = 2;

/// Where a forward's amax comes from.
enum class AmaxSource {
  x,      ///< max |x| over these tokens: the whole layer
  stats,  ///< stats[0] as given, e.g. reduced over the shards of a sharded x (see local_amax)
};

/// One forward's tensors. Device pointers to contiguous row-major data, each aligned to its
/// element size: x [tokens, in_features], logits [tokens], weight [out_features, in_features]
/// (nn.Linear's layout), bias [out_features] or nullptr, out [tokens, out_features], mixed
/// [tokens, in_features] and stats [stats_floats] (amax, scale), which a backward reads. `out`,
/// `mixed` and `stats` must not overlap an input or each other.
template <typename X, typename G = X, typename L = X>
struct ForwardArgs {
  const X* x = nullptr;
  const L* logits = nullptr;
  const G* weight = nullptr;
  const G* bias = nullptr;
  /// Or, for a 16-bit G, the weight (and bias) in float32 as a framework keeps its parameters
  /// under autocast, in place of `weight` (`bias`): run() casts them to G (round to nearest even,
  /// autocast's cast) into its workspace, of workspace_bytes(args).
  const float* weight_fp32 = nullptr;
  const float* bias_fp32 = nullptr;
  G* out = nullptr;
  G* mixed = nullptr;
  float* stats = nullptr;
  std::int64_t tokens = 0;
  /// AmaxSource::stats: amax is stats[0] as given (any non-negative float or NaN, e.g. the
  /// maximum over the shards of a sharded x, see ForwardPlan::local_amax) and only the scale is
  /// written to stats[1]; the result then equals the whole layer's bit for bit.
  AmaxSource amax_source = AmaxSource::x;
};

/// The forward: amax, quant-blend and the GEMM, for one shape and every token count up to
/// max_tokens; with an activation Act, of act(x).
template <typename X, typename G = X, typename L = X, typename Act = Identity>
class ForwardPlan {
  static_assert(supported_types<X, G, L>,
                "ForwardPlan<X, G, L>: one element type, or fp32 x with a bf16/fp16 GEMM and the "
                "logits in fp32 or in the GEMM's type");
  static_assert(detail::is_activation<Act>, "ForwardPlan: Act is one of qbl::Activations");

 public:
  using x_type = X;
  using gemm_type = G;
  using logits_type = L;
  using activation = Act;
  using ForwardArgs = qbl::ForwardArgs<X, G, L>;

  /// Plans the GEMM on the current device, which every run() must also run on.
  /// \throws qbl::invalid_argument for non-positive or overflowing sizes, qbl::cublas_error /
  ///         qbl::cuda_error if planning fails.
  ForwardPlan(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
              const Options& options = {});

  ForwardPlan(ForwardPlan&&) noexcept = default;
  ForwardPlan& operator=(ForwardPlan&&) noexcept = default;
  ForwardPlan(const ForwardPlan&) = delete;
  ForwardPlan& operator=(const ForwardPlan&) = delete;

  /// Device bytes a run() needs: the amax kernel's per-block maxima and the GEMM's cuBLASLt
  /// workspace. Needs no initialization; not shared with concurrent work.
  std::size_t workspace_bytes() const noexcept {
    return workspace_bytes_for(gemm_.workspace_bytes());
  }
  /// The same for a run of `args`: more where it casts a float32 weight or bias (weight_fp32).
  std::size_t workspace_bytes(const ForwardArgs& args) const noexcept;

  /// The same for a plan made with Options::cublas_workspace_bytes = `cublas_workspace_bytes`.
  static std::size_t workspace_bytes_for(std::size_t cublas_workspace_bytes) noexcept;

  /// Would run() accept these arguments? (The same checks, without throwing.)
  bool supports(const ForwardArgs& args) const noexcept;

  /// stats = [amax, scale]; mixed = quant_blend(x, logits); out = mixed · weightᵀ + bias, on
  /// `stream`. tokens == 0 does nothing. With args.amax_source = AmaxSource::stats the amax is
  /// read from stats[0] and only the scale is written to stats[1].
  /// \throws qbl::logic_error (moved-from plan), qbl::invalid_argument (a null or misaligned
  ///         pointer, negative tokens, an output overlapping an input or another output, the
  ///         wrong current device), qbl::out_of_range (tokens > max_tokens) -- all before
  ///         anything is launched; qbl::cuda_error / qbl::cublas_error if a launch fails.
  void run(const ForwardArgs& args, void* workspace, cudaStream_t stream = nullptr) const;

  /// A sharded forward's first step: stats[0] = max |act(x)| over these tokens (0 for tokens == 0,
  /// the identity of the reduction); stats[1] is not touched. Then the caller reduces stats[0] over
  /// the shards -- as an unsigned integer max of its bits, which for a float with a clear sign bit
  /// orders like the value, with every NaN above +Inf: the NaN-propagating max that a float MAX
  /// reduction (fmaxf, dropping NaN) is not -- and runs run() with AmaxSource::stats.
  /// One memset and one kernel; reads nothing else, writes nothing else.
  void local_amax(const X* x, std::int64_t tokens, float* stats,
                  cudaStream_t stream = nullptr) const;

  /// Will run() with these arguments take its GEMM to cuBLASLt (true) or to the fallback kernel?
  bool uses_cublaslt(const ForwardArgs& args) const noexcept {
    return gemm_.uses_cublaslt(args.weight, args.mixed, args.out, args.bias, args.tokens);
  }

  const GemmPlan<G>& gemm() const noexcept { return gemm_; }
  std::int64_t in_features() const noexcept { return gemm_.spec().k; }
  std::int64_t out_features() const noexcept { return gemm_.spec().m; }
  std::int64_t max_tokens() const noexcept { return gemm_.max_tokens(); }
  int device() const noexcept { return device_; }

 private:
  detail::Check check(const ForwardArgs& args) const noexcept;

  GemmPlan<G> gemm_;
  int device_ = -1;
  detail::LaunchLimits limits_;  // of device_, for these types
};

/// The mutable state of a backward that runs wgrad beside dgrad: a second stream and the two
/// events that fork it from the caller's stream and join it back into it. It belongs to the
/// caller, like the workspace (BackwardPlan::run takes it), so that a plan stays immutable and two
/// backwards on two streams never share a side stream. One SideStream serves one calling stream at
/// a time -- its events carry one fork and one join -- so keep one per stream that runs backwards
/// (qbl::QuantBlendLinear owns one). Made on the current device; move-only.
///
///   qbl::SideStream side;
///   bwd.run(args, workspace, &side, stream);
class SideStream {
 public:
  /// \throws qbl::cuda_error if the stream or the events cannot be made.
  SideStream();

  SideStream(SideStream&&) noexcept = default;
  SideStream& operator=(SideStream&&) noexcept = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  /// Orders the side stream after everything enqueued on `main` so far (an event record and a
  /// wait: no host synchronization; a graph capture of `main` takes the side stream in).
  cudaError_t fork(cudaStream_t main) noexcept;
  /// Orders `main` after everything enqueued on the side stream so far.
  cudaError_t join(cudaStream_t main) noexcept;

  cudaStream_t stream() const noexcept { return stream_.get(); }
  int device() const noexcept { return device_; }
  /// False for a moved-from object.
  bool valid() const noexcept { return stream_ != nullptr; }

 private:
  detail::stream_ptr stream_;
  detail::event_ptr fork_, join_;
  int device_ = -1;
};

/// One backward's tensors: grad_out [tokens, out_features] is dL/dout; x, logits and weight are
/// the forward's inputs, `mixed` and `stats` what it saved -- or `mixed` null: then, where
/// grad_weight is wanted, it is recomputed from x, logits and stats, bit for bit what the forward
/// wrote: with wgrad beside dgrad, by a kernel of its own on the side stream ahead of wgrad;
/// otherwise by the backward's element kernel, and wgrad runs after it. Gradient outputs may be
/// nullptr (not wanted: that work is skipped). What is read: weight for grad_x and grad_logits;
/// logits and stats for those and a recomputed mixed; x for grad_logits, a recomputed mixed and,
/// with an activation, grad_x; `mixed` for grad_weight. Outputs must not overlap an input or each
/// other.
template <typename X, typename G = X, typename L = X>
struct BackwardArgs {
  const G* grad_out = nullptr;
  const X* x = nullptr;
  const L* logits = nullptr;
  const G* weight = nullptr;
  /// Or, for a 16-bit G, the weight in float32 (a framework's parameter under autocast), in place
  /// of `weight`: run() casts it to G into its workspace, beside wgrad.
  const float* weight_fp32 = nullptr;
  const G* mixed = nullptr;
  const float* stats = nullptr;
  std::int64_t tokens = 0;
  X* grad_x = nullptr;       ///< [tokens, in_features]
  L* grad_logits = nullptr;  ///< [tokens]
  G* grad_weight = nullptr;  ///< [out_features, in_features]
  G* grad_bias = nullptr;    ///< [out_features]
  /// grad_weight and grad_bias: add to what they hold (cuBLASLt's beta = 1; the bias as
  /// RN_G(old + RN_G(sum))), as frameworks accumulate over micro-batches. grad_x and
  /// grad_logits are always overwritten.
  bool accumulate = false;
  /// The gradient through the fake quantizer: the reference's zero, or straight-through.
  QuantGrad quant_grad = QuantGrad::zero;
};

/// Where a backward gets the `mixed` that wgrad reads.
enum class MixedSource {
  given,                         ///< BackwardArgs::mixed, as the forward wrote it (or no wgrad)
  recomputed_beside,             ///< a kernel of its own on the side stream, ahead of wgrad
  recomputed_in_element_kernel,  ///< the element kernel writes it too; wgrad runs after it
};

/// What one backward call does: derived once from its arguments by BackwardPlan::describe, and
/// read by the plan's argument check, its workspace layout, its schedule and its choice of the
/// element kernel. docs/api.md tabulates it.
struct BackwardDescription {
  bool runs = false;  ///< tokens > 0 and at least one gradient wanted
  // What runs.
  bool dgrad = false;   ///< the dgrad GEMM and the element kernel (grad_x or grad_logits)
  bool wgrad = false;   ///< the wgrad GEMM (grad_weight)
  bool bias = false;    ///< the bias gradient's column sum (grad_bias)
  bool beside = false;  ///< dgrad and wgrad/bias both run, and overlaps(tokens): wgrad may fork
  bool fork = false;    ///< beside, and a side stream given: wgrad and bias on it
  MixedSource mixed = MixedSource::given;
  bool cast_weight = false;      ///< weight_fp32 given and dgrad runs: cast into the workspace
  bool g_mixed_scratch = false;  ///< dgrad's product in the workspace (not formed in grad_x)
  /// The element kernel on the caller's stream: what it writes (qbl::detail's variant list).
  bool element_grad_x = false, element_grad_logits = false, element_mixed = false;
  // What is read.
  bool reads_x = false;       ///< grad_logits, a recomputed mixed, or an activation's grad_x
  bool reads_gate = false;    ///< logits and stats: dgrad, or a recomputed mixed
  bool reads_weight = false;  ///< weight (or weight_fp32): dgrad
  bool reads_mixed = false;   ///< mixed: wgrad with mixed given
  bool recomputes() const noexcept { return mixed != MixedSource::given; }
};

/// The backward, as the autograd of the reference module (g = grad_out):
///   g_mixed     = g · weight                                  (dgrad GEMM, rounded to G)
///   grad_x      = g_mixed * (1 - alpha)  [+ g_mixed * alpha with QuantGrad::straight_through]
///   grad_logits = sigmoid_backward(sum_f g_mixed * x_q - sum_f g_mixed * x, alpha)
///   grad_weight = gᵀ · mixed                                  (wgrad GEMM)
///   grad_bias   = sum over tokens of g                        (qbl::bias_grad's column sum)
/// With an activation, x in these formulas is act(x) and grad_x becomes RN_X(act'(grad_x, x)),
/// the gradient of the layer's input.
template <typename X, typename G = X, typename L = X, typename Act = Identity>
class BackwardPlan {
  static_assert(supported_types<X, G, L>,
                "BackwardPlan<X, G, L>: one element type, or fp32 x with a bf16/fp16 GEMM and the "
                "logits in fp32 or in the GEMM's type");
  static_assert(detail::is_activation<Act>, "BackwardPlan: Act is one of qbl::Activations");

 public:
  using x_type = X;
  using gemm_type = G;
  using logits_type = L;
  using activation = Act;
  using BackwardArgs = qbl::BackwardArgs<X, G, L>;

  /// Plans dgrad and wgrad on the current device and decides where wgrad may run beside dgrad
  /// (Options::overlap_wgrad).
  /// \throws as ForwardPlan's constructor.
  BackwardPlan(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
               const Options& options = {});

  BackwardPlan(BackwardPlan&&) noexcept = default;
  BackwardPlan& operator=(BackwardPlan&&) noexcept = default;
  BackwardPlan(const BackwardPlan&) = delete;
  BackwardPlan& operator=(const BackwardPlan&) = delete;

  /// Device bytes run(args) needs: the GEMMs' cuBLASLt workspaces (two where wgrad may run beside
  /// dgrad), the column sum's partial sums, a g_mixed scratch of [tokens, in_features] in G
  /// (where dgrad runs and grad_x is not wanted or is of another type) and, where mixed is
  /// recomputed (args.mixed null with grad_weight wanted), room for it; where the weight comes as
  /// weight_fp32, room for its cast. Needs no initialization; not shared with concurrent work.
  std::size_t workspace_bytes(const BackwardArgs& args) const noexcept;
  /// The most any run() with up to `tokens` tokens and a weight of type G needs (default:
  /// max_tokens).
  std::size_t workspace_bytes(std::int64_t tokens) const noexcept;
  std::size_t workspace_bytes() const noexcept { return workspace_bytes(max_tokens()); }

  /// workspace_bytes(tokens) of the plan these sizes and options make, without making it.
  static std::size_t workspace_bytes_for(std::int64_t in_features, std::int64_t out_features,
                                         std::int64_t max_tokens, std::int64_t tokens,
                                         const Options& options) noexcept;

  /// Would run() accept these arguments (with a workspace of workspace_bytes(args))?
  bool supports(const BackwardArgs& args) const noexcept;

  /// The backward on `stream`. When both GEMMs run, overlaps(tokens) and `side` is given, wgrad
  /// (and the bias gradient) run on side->stream(), forked from `stream` and joined back into it
  /// (no host synchronization; a graph capture of `stream` takes it in); otherwise on `stream`,
  /// ahead of dgrad (after the element kernel where that kernel recomputes mixed), with the same
  /// bits. Either way all of run()'s work is ordered before what is enqueued on `stream` after
  /// it. tokens == 0, or no output wanted, does nothing.
  /// \throws as ForwardPlan::run; qbl::invalid_argument for a side stream of another device.
  void run(const BackwardArgs& args, void* workspace, SideStream* side,
           cudaStream_t stream = nullptr) const;

  /// Does a run with `tokens` tokens (and a side stream) put wgrad beside dgrad?
  bool overlaps(std::int64_t tokens) const noexcept { return tokens <= overlap_tokens_; }

  /// What run(args, ..., side) does, with a side stream given or not (`side_stream`).
  BackwardDescription describe(const BackwardArgs& args, bool side_stream = true) const noexcept;

  const GemmPlan<G>& dgrad() const noexcept { return dgrad_; }
  const GemmPlan<G>& wgrad() const noexcept { return wgrad_; }
  std::int64_t in_features() const noexcept { return dgrad_.spec().m; }
  std::int64_t out_features() const noexcept { return dgrad_.spec().k; }
  std::int64_t max_tokens() const noexcept { return dgrad_.max_tokens(); }
  int device() const noexcept { return device_; }

 private:
  struct Layout;  // offsets of the workspace's parts
  static Layout layout_for(std::int64_t in, std::int64_t out, std::int64_t tokens,
                           std::size_t cublas_workspace_bytes,
                           const BackwardDescription& d) noexcept;
  /// The description with every part a run of `tokens` tokens can have: the most workspace.
  static BackwardDescription largest(bool beside) noexcept;
  detail::Check check(const BackwardArgs& args, const BackwardDescription& d) const noexcept;

  GemmPlan<G> dgrad_, wgrad_;
  std::int64_t overlap_tokens_ = 0;  ///< wgrad beside dgrad up to this token count
  int device_ = -1, sms_ = 0;
  int element_blocks_ = 0;  ///< detail::backward_max_blocks: the element kernel's most blocks
};

}  // namespace qbl

#include <qbl/detail/layer_plans.inl>
