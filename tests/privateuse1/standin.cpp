// A PrivateUse1 backend that behaves like DirectML (torch-directml) where shadow can tell, for tests on
// machines without a DirectX 12 adapter. See tests/privateuse1/__init__.py for what it models and why.
//
// - Device memory of its own: an allocator of its own; no CPU tensor ever holds a device storage, and values
//   leave the device only through its copies (copy_, _copy_from, _copy_from_and_resize, _local_scalar_dense).
// - float64 is refused with DirectML's message: a device allocation in float64 (or complex128), and a copy
//   between the device and the CPU that converts to or from float64 (DirectML converts on the device).
//   bfloat16 is refused too (DirectML has no bfloat16).
// - The ops torch-directml 0.2.5 registers are device kernels here (Python registers them by name, from
//   directml_ops.json): each runs the CPU kernel on the device memory viewed as CPU tensors, float32 for
//   float32, as DirectML's arithmetic is float32; a handful compute the way a GPU does instead (a matmul
//   summing K in blocks, float16 matmuls accumulating in float16, exp as exp2(x * log2 e)). Every other op
//   goes through a boxed CPU fallback (at::native::cpu_fallback), warning once per op as DirectML does.
// - Views share the device storage; in-place and out= ops write it; random ops draw from a generator of the
//   device's own (the CPU's default generator is never drawn from).
// - Counters of the host traffic (device-to-host and host-to-device copies, .item() reads) made by callers,
//   not by this backend's own kernels, and the set of ops run through the fallback.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/reshape_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

// torch 2.5 gave PrivateUse1HooksInterface isBuilt/isAvailable/isPinnedPtr and made getDefaultGenerator const
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define STANDIN_HOOKS_2_5 1
#else
#define STANDIN_HOOKS_2_5 0
#endif
// torch 2.6 asks the hooks for new generators (REGISTER_GENERATOR_PRIVATEUSE1 is deprecated there)
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define STANDIN_HOOKS_2_6 1
#else
#define STANDIN_HOOKS_2_6 0
#endif

namespace standin {
namespace {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;
constexpr const char* kNoDouble = "The GPU device does not support Double (Float64) operations!";

// --- counters: host traffic asked for from outside this backend's kernels ---
thread_local int depth = 0;  // this backend's kernels on the stack
struct Inside {
  Inside() { ++depth; }
  ~Inside() { --depth; }
  Inside(const Inside&) = delete;
  Inside& operator=(const Inside&) = delete;
};
std::atomic<int64_t> device_to_host{0}, host_to_device{0}, item_reads{0}, allocated{0};
std::mutex fell_back_lock;
std::set<std::string> fell_back;  // the ops run through the CPU fallback since the counters were reset

// --- memory ---
void free_block(void* ctx) {
  if (ctx != nullptr) {
    auto* header = static_cast<int64_t*>(ctx);
    allocated -= header[0];
    std::free(ctx);
  }
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // a header of 64 bytes holds the size (for the counter) and keeps the data 64-byte aligned
    void* ctx = nullptr;
    if (posix_memalign(&ctx, 64, nbytes + 64) != 0 || ctx == nullptr) {
      TORCH_CHECK(false, "privateuseone stand-in: out of memory allocating ", nbytes, " bytes");
    }
    static_cast<int64_t*>(ctx)[0] = static_cast<int64_t>(nbytes);
    allocated += static_cast<int64_t>(nbytes);
    void* data = static_cast<char*>(ctx) + 64;
    return {data, ctx, &free_block, c10::Device(kDevice, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
DeviceAllocator device_allocator;
REGISTER_ALLOCATOR(kDevice, &device_allocator);

void check_dtype(c10::ScalarType dtype) {
  TORCH_CHECK(dtype != at::kDouble && dtype != at::kComplexDouble, kNoDouble);
  TORCH_CHECK(dtype != at::kBFloat16,
              "The GPU device does not support BFloat16 operations! (DirectML has no bfloat16 data type)");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  Inside in;
  const auto type = c10::dtype_or_default(dtype);
  check_dtype(type);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "privateuseone: only strided tensors");
  return at::detail::empty_generic(size, &device_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   type, memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  Inside in;
  const auto type = c10::dtype_or_default(dtype);
  check_dtype(type);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "privateuseone: only strided tensors");
  return at::detail::empty_strided_generic(size, stride, &device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), type);
}

// A device tensor on fresh device memory: a copy of a CPU tensor's whole storage, with its geometry.
at::Tensor to_device(const at::Tensor& host) {
  check_dtype(host.scalar_type());
  const auto nbytes = host.storage().nbytes();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, device_allocator.allocate(nbytes), &device_allocator,
                       /*resizable=*/true);
  if (nbytes) {
    std::memcpy(storage.mutable_data(), host.storage().data(), nbytes);
  }
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                    c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), host.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
  t._set_conj(host.is_conj());
  t._set_neg(host.is_neg());
  return t;
}

// The device memory of t read as a CPU tensor of t's geometry: never handed out of this backend. Its storage
// may grow (a CPU kernel resizing an out= argument): it then moves to CPU memory, and write_back brings it over.
at::Tensor host_view(const at::Tensor& t) {
  if (t._is_zerotensor()) {
    return at::_efficientzerotensor(t.sizes(), t.options().device(c10::kCPU));
  }
  const auto& st = t.storage();
  c10::Storage alias(c10::Storage::use_byte_size_t(), st.nbytes(),
                     c10::DataPtr(const_cast<void*>(st.data()), c10::Device(c10::kCPU)), c10::GetCPUAllocator(),
                     /*resizable=*/true);
  auto h = at::detail::make_tensor<c10::TensorImpl>(std::move(alias), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                    t.dtype());
  h.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  h._set_conj(t.is_conj());
  h._set_neg(t.is_neg());
  return h;
}

bool on_device(const at::Tensor& t) { return t.defined() && t.device().type() == kDevice; }

// --- random numbers: a generator of the device's own, drawing from a CPU generator it holds ---
struct DeviceGenerator : public c10::GeneratorImpl {
  explicit DeviceGenerator(c10::DeviceIndex index = 0)
      : c10::GeneratorImpl(c10::Device(kDevice, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return cpu.unsafeGetGeneratorImpl()->get_state(); }
  static c10::DeviceType device_type() { return kDevice; }
  at::Generator cpu;

 private:
  DeviceGenerator* clone_impl() const override {
    auto* g = new DeviceGenerator(device().index());
    g->cpu = cpu.clone();
    return g;
  }
};

at::Generator make_generator(c10::DeviceIndex index) { return at::make_generator<DeviceGenerator>(index); }
#if !STANDIN_HOOKS_2_6
REGISTER_GENERATOR_PRIVATEUSE1(make_generator)
#endif

const at::Generator& default_generator() {
  static at::Generator g = make_generator(0);
  return g;
}

// The generator a CPU kernel draws from for a generator argument: a device generator's CPU generator; None stays
// None (the CPU's default generator, which holds the device's state while a random op runs: DeviceRandom).
c10::IValue cpu_generator(const c10::IValue& v) {
  if (v.isNone() || v.toGenerator().device().type() != kDevice) {
    return v;
  }
  return static_cast<DeviceGenerator*>(v.toGenerator().unsafeGetGeneratorImpl())->cpu;
}

// While a random op runs on the CPU, the CPU's default generator holds the device default generator's state (ops
// such as native_dropout draw from the default generator without a generator argument); after it, each gets its
// own back: the device's advanced, the CPU's as it was.
struct DeviceRandom {
  explicit DeviceRandom(const c10::OperatorHandle& op) : active(op.hasTag(at::Tag::nondeterministic_seeded)) {
    if (active) {
      auto cpu = at::detail::getDefaultCPUGenerator();
      saved = cpu.get_state();
      cpu.set_state(device_cpu().get_state());
    }
  }
  ~DeviceRandom() {
    if (active) {
      auto cpu = at::detail::getDefaultCPUGenerator();
      device_cpu().set_state(cpu.get_state());
      cpu.set_state(saved);
    }
  }
  DeviceRandom(const DeviceRandom&) = delete;
  DeviceRandom& operator=(const DeviceRandom&) = delete;

 private:
  static at::Generator device_cpu() {
    return static_cast<DeviceGenerator*>(default_generator().unsafeGetGeneratorImpl())->cpu;
  }
  bool active;
  at::Tensor saved;
};

bool is_generator_arg(const c10::Argument& a) {
  auto type = a.real_type();
  if (auto opt = type->cast<c10::OptionalType>()) {
    type = opt->getElementType();
  }
  return type->kind() == c10::TypeKind::GeneratorType;
}

// --- running an op's CPU kernel on the device memory ---
struct Pair {
  at::Tensor device, host;
  const void* data;  // the host view's data pointer before the call
  size_t nbytes;
};

// Device tensors of the argument list replaced by host views (kept in `pairs`); device arguments by the CPU;
// generator arguments by the CPU generator of the device's.
c10::IValue to_host(const c10::IValue& v, std::vector<Pair>& pairs) {
  auto convert = [&](const at::Tensor& t) -> at::Tensor {
    if (!on_device(t)) {
      return t;
    }
    auto h = host_view(t);
    pairs.push_back({t, h, h.storage().data(), h.storage().nbytes()});
    return h;
  };
  if (v.isTensor()) {
    return convert(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(convert(t));
    }
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
      out.push_back(t.has_value() && t->defined() ? std::optional<at::Tensor>(convert(*t)) : t);
    }
    return out;
  }
  if (v.isDevice() && v.toDevice().type() == kDevice) {
    return c10::Device(c10::kCPU);
  }
  return v;
}

// After a CPU kernel wrote a host view: its storage moved to CPU memory (a resize), or its geometry changed.
void write_back(const Pair& p) {
  const auto& hs = p.host.storage();
  auto* impl = p.device.unsafeGetTensorImpl();
  if (hs.data() != p.data || hs.nbytes() != p.nbytes) {
    const auto nbytes = hs.nbytes();
    auto& ds = const_cast<c10::Storage&>(p.device.storage());
    if (nbytes > ds.nbytes()) {
      ds.set_data_ptr_noswap(device_allocator.allocate(nbytes));
      ds.set_nbytes(nbytes);
    }
    if (nbytes) {
      std::memcpy(ds.mutable_data(), hs.data(), nbytes);
    }
  }
  if (p.host.sizes() != p.device.sizes() || p.host.strides() != p.device.strides() ||
      p.host.storage_offset() != p.device.storage_offset()) {
    impl->set_sizes_and_strides(p.host.sizes(), p.host.strides(), p.host.storage_offset());
  }
}

// A tensor a CPU kernel returned, as a device tensor: the device tensor itself, a view of its storage, or a copy.
at::Tensor to_device_result(const at::Tensor& h, const std::vector<Pair>& pairs) {
  if (!h.defined() || h.device().type() != c10::kCPU) {
    return h;
  }
  for (const auto& p : pairs) {
    if (h.unsafeGetTensorImpl() == p.host.unsafeGetTensorImpl()) {
      return p.device;
    }
  }
  for (const auto& p : pairs) {
    if (h.storage().unsafeGetStorageImpl() == p.host.storage().unsafeGetStorageImpl()) {
      auto view = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(p.device.storage()),
                                                           p.device.key_set(), h.dtype());
      view.unsafeGetTensorImpl()->set_sizes_and_strides(h.sizes(), h.strides(), h.storage_offset());
      view._set_conj(h.is_conj());
      view._set_neg(h.is_neg());
      return view;
    }
  }
  if (h._is_zerotensor()) {
    check_dtype(h.scalar_type());
    return at::_efficientzerotensor(h.sizes(), h.options().device(c10::Device(kDevice, 0)));
  }
  return to_device(h);
}

c10::IValue result_to_device(const c10::IValue& v, const std::vector<Pair>& pairs) {
  if (v.isTensor()) {
    return to_device_result(v.toTensor(), pairs);
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) {
      out.push_back(to_device_result(t, pairs));
    }
    return out;
  }
  return v;
}

using Body = void (*)(const c10::OperatorHandle&, torch::jit::Stack*);

at::Tensor optional_arg(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }

// Run `body` on the stack with every device tensor replaced by its host view, then bring the results back.
void on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, Body body) {
  Inside in;
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto begin = stack->size() - args.size();
  std::vector<Pair> pairs;
  for (size_t i = 0; i < args.size(); ++i) {
    auto& v = (*stack)[begin + i];
    v = is_generator_arg(args[i]) ? cpu_generator(v) : to_host(v, pairs);
  }
  {
    DeviceRandom random(op);
    body(op, stack);
  }
  for (const auto& p : pairs) {
    write_back(p);
  }
  const auto nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    (*stack)[i] = result_to_device((*stack)[i], pairs);
  }
}

void cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// A device kernel of an op DirectML registers: the CPU kernel on the device memory.
void device_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  on_host(op, stack, &cpu_kernel);
}

// --- kernels whose arithmetic is a GPU's, not the CPU's ---
constexpr int64_t kBlock = 16;  // the K block a matmul sums at once; blocks are then added pairwise

// A @ B (matrices or batches of them) as a GPU sums it: float32 in blocks of K added pairwise; float16 in float16,
// one rounding to float16 per term (an accumulator of the inputs' own type). Other dtypes: the CPU's matmul.
at::Tensor device_matmul(const at::Tensor& a, const at::Tensor& b) {
  const int64_t K = a.size(-1);
  if (a.scalar_type() == at::kHalf) {
    auto sizes = a.sizes().vec();
    sizes.back() = b.size(-1);
    auto acc = at::zeros(sizes, a.options());
    auto a32 = a.to(at::kFloat), b32 = b.to(at::kFloat);
    for (int64_t k = 0; k < K; ++k) {
      acc = at::addcmul(acc.to(at::kFloat), a32.narrow(-1, k, 1), b32.narrow(-2, k, 1)).to(at::kHalf);
    }
    return acc;
  }
  if (a.scalar_type() != at::kFloat || K <= kBlock) {
    return at::matmul(a, b);
  }
  std::vector<at::Tensor> partial;
  for (int64_t k = 0; k < K; k += kBlock) {
    const int64_t n = std::min(kBlock, K - k);
    partial.push_back(at::matmul(a.narrow(-1, k, n), b.narrow(-2, k, n)));
  }
  while (partial.size() > 1) {
    std::vector<at::Tensor> next;
    for (size_t i = 0; i + 1 < partial.size(); i += 2) {
      next.push_back(partial[i] + partial[i + 1]);
    }
    if (partial.size() % 2) {
      next.push_back(partial.back());
    }
    partial.swap(next);
  }
  return partial[0];
}

// beta * c + alpha * product, as a GEMM's epilogue forms it; beta == 0 ignores c (NaN included), as BLAS does.
at::Tensor epilogue(const at::Tensor& c, const at::Tensor& product, const c10::Scalar& beta, const c10::Scalar& alpha) {
  at::Tensor scaled = alpha.equal(1) ? product : product * alpha;
  if (beta.equal(0)) {
    return scaled;
  }
  return at::add(beta.equal(1) ? c : c * beta, scaled);
}

void store(at::Tensor out, const at::Tensor& value) {
  at::native::resize_output(out, value.sizes());
  out.copy_(value);
}

bool gpu_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf; }

// mm.out(self, mat2, *, out), bmm.out(self, mat2, *, out)
void mm_body(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto out = (*stack)[stack->size() - 1].toTensor();
  auto a = (*stack)[stack->size() - 3].toTensor(), b = (*stack)[stack->size() - 2].toTensor();
  if (!gpu_dtype(a)) {
    return cpu_kernel(op, stack);
  }
  store(out, device_matmul(a, b));
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, out);
}

// addmm.out(self, mat1, mat2, *, beta, alpha, out), baddbmm.out(self, batch1, batch2, *, beta, alpha, out)
void addmm_body(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto c = (*stack)[n - 6].toTensor(), a = (*stack)[n - 5].toTensor(), b = (*stack)[n - 4].toTensor();
  if (!gpu_dtype(a)) {
    return cpu_kernel(op, stack);
  }
  auto beta = (*stack)[n - 3].toScalar(), alpha = (*stack)[n - 2].toScalar();
  auto out = (*stack)[n - 1].toTensor();
  // the epilogue in float32, rounded once to the output's type
  store(out, epilogue(c.to(at::kFloat), device_matmul(a, b).to(at::kFloat), beta, alpha).to(out.scalar_type()));
  torch::jit::drop(*stack, 6);
  torch::jit::push(*stack, out);
}

// dot(self, tensor): the blocked sum of a 1 x K by K x 1 product
void dot_body(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto a = (*stack)[n - 2].toTensor(), b = (*stack)[n - 1].toTensor();
  if (!gpu_dtype(a)) {
    return cpu_kernel(op, stack);
  }
  auto r = device_matmul(a.unsqueeze(0), b.unsqueeze(1)).reshape({});
  torch::jit::drop(*stack, 2);
  torch::jit::push(*stack, r);
}

// exp.out(self, *, out): exp2(x * log2 e), both steps in float32 (CUDA's __expf, fast-math exp): the rounding of
// the product grows with |x|, about |x| / 2 ulps of the result.
void exp_body(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto x = (*stack)[n - 2].toTensor(), out = (*stack)[n - 1].toTensor();
  if (!gpu_dtype(x)) {
    return cpu_kernel(op, stack);
  }
  auto r = at::exp2(x.to(at::kFloat) * 1.4426950408889634).to(x.scalar_type());
  store(out, r);
  torch::jit::drop(*stack, 2);
  torch::jit::push(*stack, out);
}

// --- convolutions: aten picks the "overrideable" convolution on PrivateUse1 devices (DirectML registers it); here
// the CPU's convolution on the device memory ---
int64_t as_int(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().expect_int(); }

std::vector<int64_t> as_ints(const c10::IValue& v) {
  if (v.isIntList()) {
    return v.toIntVector();
  }
  std::vector<int64_t> out;
  for (const auto& s : v.toSymIntVector()) {
    out.push_back(s.expect_int());
  }
  return out;
}

// convolution_overrideable(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
void convolution_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto r = at::convolution((*stack)[n - 9].toTensor(), (*stack)[n - 8].toTensor(), optional_arg((*stack)[n - 7]),
                           as_ints((*stack)[n - 6]), as_ints((*stack)[n - 5]), as_ints((*stack)[n - 4]),
                           (*stack)[n - 3].toBool(), as_ints((*stack)[n - 2]), as_int((*stack)[n - 1]));
  torch::jit::drop(*stack, 9);
  torch::jit::push(*stack, r);
}

// convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation, transposed,
//                                   output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
void convolution_backward_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto weight = (*stack)[n - 8].toTensor();
  const bool transposed = (*stack)[n - 4].toBool();
  const int64_t groups = as_int((*stack)[n - 2]);
  auto mask = (*stack)[n - 1].toBoolList();
  std::array<bool, 3> output_mask = {mask[0], mask[1], mask[2]};
  std::vector<int64_t> bias_sizes = {transposed ? weight.size(1) * groups : weight.size(0)};
  auto r = at::convolution_backward((*stack)[n - 10].toTensor(), (*stack)[n - 9].toTensor(), weight, bias_sizes,
                                    as_ints((*stack)[n - 7]), as_ints((*stack)[n - 6]), as_ints((*stack)[n - 5]),
                                    transposed, as_ints((*stack)[n - 3]), groups, output_mask);
  torch::jit::drop(*stack, 10);
  torch::jit::push(*stack, std::get<0>(r), std::get<1>(r), std::get<2>(r));
}

template <Body body>
void own_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  on_host(op, stack, body);
}

// --- the fused RNN cells that aten's LSTM and GRU call on PrivateUse1 devices (aten's CPU has no kernel) ---
// Their arithmetic is CUDA's (aten/src/ATen/native/cuda/RNN.cu), in float32.

std::vector<at::Tensor> gates(const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& b1,
                              const at::Tensor& b2, int64_t n) {
  auto g = ig.to(at::kFloat) + hg.to(at::kFloat);
  if (b1.defined()) {
    g = g + b1.to(at::kFloat);
    g = g + b2.to(at::kFloat);
  }
  return g.chunk(n, 1);
}

// _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias) -> (hy, cy, workspace)
void lstm_cell_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto ig = (*stack)[n - 5].toTensor(), hg = (*stack)[n - 4].toTensor(), cx = (*stack)[n - 3].toTensor();
  auto b1 = optional_arg((*stack)[n - 2]), b2 = optional_arg((*stack)[n - 1]);
  auto type = ig.scalar_type();
  auto g = gates(ig, hg, b1, b2, 4);
  auto i = g[0].sigmoid(), f = g[1].sigmoid(), c = g[2].tanh(), o = g[3].sigmoid();
  auto cy = f * cx.to(at::kFloat) + i * c;
  auto hy = o * cy.tanh();
  auto workspace = at::cat({i, f, c, o}, 1);
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, hy.to(type), cy.to(type), workspace.to(type));
}

// _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias) -> (grad_gates, grad_cx, grad_bias)
void lstm_cell_backward_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto ghy = optional_arg((*stack)[n - 6]), gcy = optional_arg((*stack)[n - 5]);
  auto cx = (*stack)[n - 4].toTensor(), cy = (*stack)[n - 3].toTensor(), ws = (*stack)[n - 2].toTensor();
  bool has_bias = (*stack)[n - 1].toBool();
  torch::jit::drop(*stack, 6);
  if (!ghy.defined() && !gcy.defined()) {
    torch::jit::push(*stack, at::Tensor(), at::Tensor(), at::Tensor());
    return;
  }
  auto type = ws.scalar_type();
  auto w = ws.to(at::kFloat).chunk(4, 1);
  auto &i = w[0], &f = w[1], &c = w[2], &o = w[3];
  auto go = ghy.defined() ? ghy.to(at::kFloat) : at::zeros_like(cy, cy.options().dtype(at::kFloat));
  auto goc = gcy.defined() ? gcy.to(at::kFloat) : at::zeros_like(go);
  auto tcy = cy.to(at::kFloat).tanh();
  auto gog = go * tcy;
  auto gcx = go * o * (1 - tcy * tcy) + goc;
  auto gig = gcx * c * (1 - i) * i;
  auto gfg = gcx * cx.to(at::kFloat) * (1 - f) * f;
  auto gcg = gcx * i * (1 - c * c);
  gog = gog * (1 - o) * o;
  auto grad_gates = at::cat({gig, gfg, gcg, gog}, 1).to(type);
  auto grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  torch::jit::push(*stack, grad_gates, (gcx * f).to(type), grad_bias);
}

// _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias, hidden_bias) -> (hy, workspace)
void gru_cell_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto ig = (*stack)[n - 5].toTensor(), hg = (*stack)[n - 4].toTensor(), hx = (*stack)[n - 3].toTensor();
  auto b1 = optional_arg((*stack)[n - 2]), b2 = optional_arg((*stack)[n - 1]);
  auto type = ig.scalar_type();
  auto i3 = ig.to(at::kFloat).chunk(3, 1), h3 = hg.to(at::kFloat).chunk(3, 1);
  std::vector<at::Tensor> bi(3), bh(3);
  if (b1.defined()) {
    bi = b1.to(at::kFloat).chunk(3, 0);
    bh = b2.to(at::kFloat).chunk(3, 0);
  }
  auto sum = [&](int k) { return b1.defined() ? i3[k] + h3[k] + bi[k] + bh[k] : i3[k] + h3[k]; };
  auto r = sum(0).sigmoid(), z = sum(1).sigmoid();
  auto hn = b1.defined() ? h3[2] + bh[2] : h3[2];
  auto ng = ((b1.defined() ? i3[2] + bi[2] : i3[2]) + r * hn).tanh();
  auto hxf = hx.to(at::kFloat);
  auto hy = ng + z * (hxf - ng);
  auto workspace = at::cat({r, z, ng, hxf, hn}, 1);
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, hy.to(type), workspace.to(type));
}

// _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)
//   -> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)
void gru_cell_backward_body(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto n = stack->size();
  auto go = (*stack)[n - 3].toTensor(), ws = (*stack)[n - 2].toTensor();
  bool has_bias = (*stack)[n - 1].toBool();
  auto type = go.scalar_type();
  auto w = ws.to(at::kFloat).chunk(5, 1);
  auto &r = w[0], &z = w[1], &ng = w[2], &hx = w[3], &hn = w[4];
  auto g = go.to(at::kFloat);
  auto gz = g * (hx - ng) * (1 - z) * z;
  auto ghx = g * z;
  auto gn = g * (1 - z) * (1 - ng * ng);
  auto ghn = gn * r;
  auto gr = gn * hn * (1 - r) * r;
  auto gi = at::cat({gr, gz, gn}, 1).to(type), gh = at::cat({gr, gz, ghn}, 1).to(type);
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, gi, gh, ghx.to(type), has_bias ? gi.sum(0) : at::Tensor(),
                   has_bias ? gh.sum(0) : at::Tensor());
}

// --- copies between the device and the host: the only way values leave the device ---
void copy_values(const at::Tensor& src, const at::Tensor& dst) {
  const bool from = on_device(src), to = on_device(dst);
  if (from != to && src.scalar_type() != dst.scalar_type()) {
    // DirectML converts on the device: a conversion from or to float64 needs float64 there
    check_dtype(src.scalar_type());
    check_dtype(dst.scalar_type());
  }
  if (depth == 1) {
    if (from && !to) {
      ++device_to_host;
    } else if (to && !from) {
      ++host_to_device;
    }
  }
  auto s = from ? host_view(src) : src;
  auto d = to ? host_view(dst) : dst;
  d.copy_(s);
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  Inside in;
  copy_values(src, self);
  return self;
}

at::Tensor _copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  Inside in;
  copy_values(self, dst);
  return dst;
}

at::Tensor _copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  Inside in;
  if (dst.sizes() != self.sizes()) {
    dst.resize_(self.sizes());
  }
  copy_values(self, dst);
  return dst;
}

c10::Scalar _local_scalar_dense(const at::Tensor& self) {
  Inside in;
  if (depth == 1) {
    ++item_reads;
  }
  return at::_local_scalar_dense(host_view(self));
}

at::Tensor _efficientzerotensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                                std::optional<bool> pin_memory) {
  Inside in;
  struct ZeroAllocator final : c10::Allocator {  // no memory: reading a zero tensor's storage is an error
    c10::DataPtr allocate(size_t) override { return {nullptr, c10::Device(kDevice, 0)}; }
    void copy_data(void*, const void*, std::size_t) const override {}
  };
  static ZeroAllocator zeros;
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, &zeros, keys, c10::dtype_or_default(dtype), std::nullopt);
}

// --- everything else: DirectML's CPU fallback ---
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Inside in;
  static std::mutex lock;
  static std::set<std::string> warned;
  const auto name = c10::toString(op.schema().operator_name());
  {
    std::lock_guard<std::mutex> guard(fell_back_lock);
    fell_back.insert(name);
  }
  {
    std::lock_guard<std::mutex> guard(lock);
    if (warned.insert(name).second) {
      TORCH_WARN("The operator '", name, "' is not currently supported on the DML backend and will fall back to run "
                 "on the CPU. This may have performance implications.");
    }
  }
  const auto& args = op.schema().arguments();
#if !STANDIN_HOOKS_2_5
  // torch 2.4's cpu_fallback fails writing a mutable tensor list back (_fused_adam_'s): run those ops in place
  for (const auto& a : args) {
    if (a.alias_info() != nullptr && a.alias_info()->isWrite() && a.type()->kind() == c10::TypeKind::ListType) {
      on_host(op, stack, &cpu_kernel);
      return;
    }
  }
#endif
  const auto begin = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_generator_arg(args[i])) {
      (*stack)[begin + i] = cpu_generator((*stack)[begin + i]);
    }
  }
  DeviceRandom random(op);
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

// --- the device: one, synchronous ---
struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  GuardImpl() = default;
  explicit GuardImpl(c10::DeviceType t) { TORCH_INTERNAL_ASSERT(t == kDevice); }
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device d) const override { return c10::Device(kDevice, 0); }
  c10::Device getDevice() const override { return c10::Device(kDevice, 0); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "privateuseone stand-in: there is one device, privateuseone:0");
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

struct Hooks final : public at::PrivateUse1HooksInterface {
#if STANDIN_HOOKS_2_5
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool isPinnedPtr(const void*) const override { return false; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override { return default_generator(); }
#else
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) override { return default_generator(); }
#endif
#if STANDIN_HOOKS_2_6
  at::Generator getNewGenerator(c10::DeviceIndex index) const override { return make_generator(index); }
#endif
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kDevice, 0); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
};

int register_hooks() {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return 0;
}
const int hooks_registered = register_hooks();

}  // namespace

// Ops with a kernel of this file's own (not the generic device kernel). Python registers the generic one for
// the rest of DirectML's list.
const std::vector<std::string> kOwnKernels = {
    "empty.memory_format", "empty_strided", "_efficientzerotensor", "copy_", "_copy_from", "_copy_from_and_resize",
    "_local_scalar_dense", "mm.out", "bmm.out", "addmm.out", "baddbmm.out", "dot", "exp.out",
    "convolution_overrideable", "convolution_backward_overrideable"};
// Not in DirectML's list, registered all the same: aten's LSTM and GRU call them on every PrivateUse1 device, and
// aten's CPU has no kernel for them (a fallback would fail).
const std::vector<std::string> kExtraKernels = {"_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl",
                                                "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward"};

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_efficientzerotensor", _efficientzerotensor);
  m.impl("copy_", copy_);
  m.impl("_copy_from", _copy_from);
  m.impl("_copy_from_and_resize", _copy_from_and_resize);
  m.impl("_local_scalar_dense", _local_scalar_dense);
  m.impl("mm.out", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&mm_body>>());
  m.impl("bmm.out", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&mm_body>>());
  m.impl("addmm.out", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&addmm_body>>());
  m.impl("baddbmm.out", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&addmm_body>>());
  m.impl("dot", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&dot_body>>());
  m.impl("exp.out", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&exp_body>>());
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&convolution_body>>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&own_kernel<&convolution_backward_body>>());
  m.impl("_thnn_fused_lstm_cell", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&lstm_cell_body>>());
  m.impl("_thnn_fused_lstm_cell_backward_impl",
         torch::CppFunction::makeFromBoxedFunction<&own_kernel<&lstm_cell_backward_body>>());
  m.impl("_thnn_fused_gru_cell", torch::CppFunction::makeFromBoxedFunction<&own_kernel<&gru_cell_body>>());
  m.impl("_thnn_fused_gru_cell_backward",
         torch::CppFunction::makeFromBoxedFunction<&own_kernel<&gru_cell_backward_body>>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// The registrations made at load time, kept for the life of the process.
std::vector<std::unique_ptr<torch::Library>>& libraries() {
  static std::vector<std::unique_ptr<torch::Library>> libs;
  return libs;
}

// The generic device kernel for each of `names` (aten overloads, "add.out").
void register_device_kernels(const std::vector<std::string>& names) {
  static bool done = false;
  TORCH_CHECK(!done, "privateuseone stand-in: its device kernels are registered already");
  done = true;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  for (const auto& name : names) {
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&device_kernel>());
  }
  libraries().push_back(std::move(lib));
}

// reshape for AutogradPrivateUse1, as torch-directml registers it: the composite reshape (views or a copy, each with
// its gradient). A backend registering reshape for PrivateUse1 alone loses the composite kernel at its autograd key.
void register_autograd_reshape() {
  static bool done = false;
  TORCH_CHECK(!done, "privateuseone stand-in: reshape is registered for AutogradPrivateUse1 already");
  done = true;
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                              __FILE__, __LINE__);
  lib->impl("reshape", TORCH_FN(at::native::reshape_symint));
  libraries().push_back(std::move(lib));
}

py::dict counters() {
  py::dict d;
  d["device_to_host"] = device_to_host.load();
  d["host_to_device"] = host_to_device.load();
  d["item"] = item_reads.load();
  d["allocated_bytes"] = allocated.load();
  return d;
}

void reset_counters() {
  device_to_host = 0;
  host_to_device = 0;
  item_reads = 0;
  std::lock_guard<std::mutex> guard(fell_back_lock);
  fell_back.clear();
}

std::vector<std::string> fallback_ops() {
  std::lock_guard<std::mutex> guard(fell_back_lock);
  return {fell_back.begin(), fell_back.end()};
}

at::Generator device_default_generator() { return default_generator(); }

}  // namespace standin

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("own_kernels", [] { return standin::kOwnKernels; });
  m.def("extra_kernels", [] { return standin::kExtraKernels; });
  m.def("register_device_kernels", &standin::register_device_kernels);
  m.def("register_autograd_reshape", &standin::register_autograd_reshape);
  m.def("counters", &standin::counters);
  m.def("reset_counters", &standin::reset_counters);
  m.def("fallback_ops", &standin::fallback_ops);
  m.def("default_generator", &standin::device_default_generator);
}
