// flash3 forward benchmark: the paper's sweep (shared/ANCHORS.md) in TFLOP/s.
//   seqlen 512..16k, batch = 16384 / seqlen, hidden 2048 (nheads = 2048 / hdim),
//   hdim 64/128/256, causal and not; FLOPs = 4 * b * h * sq * sk * d, halved for causal.
// Timing: CUDA events around each launch, 3 warm-ups, median of --reps (default 10) runs on
// random (never zero) inputs. On a machine without a Hopper GPU it says so and exits 2.
//
// usage: flash3_bench [--dtype bf16|fp16] [--hdims 64,128,256] [--seqlens 512,...] [--reps N]
//                     [--causal 0|1|both] [--json PATH] [--ablation 1] [--variant N]
// --variant N: a flash3::detail::FwdAblation (src/fwd/fwd_ablation.h; 4: persistent also for causal).
// --ablation 1: the paper's Table 2 instead (batch 4, seqlen 8448, 16 heads, hdim 128, bf16,
// non-causal), once per technique switched off.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flash3/flash3.h"
#include "fwd/fwd_ablation.h"

namespace {

std::vector<int> parse_list(const char* s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "flash3_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__attribute__((unused)) uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> hdims = {64, 128, 256}, seqlens = {512, 1024, 2048, 4096, 8192, 16384};
  std::vector<int> causals = {0, 1};
  int reps = 10;
  flash3::DType dtype = flash3::DType::kBFloat16;
  const char* json_path = nullptr;
  bool ablation = false;
  int variant = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--hdims") hdims = parse_list(argv[i + 1]);
    else if (a == "--seqlens") seqlens = parse_list(argv[i + 1]);
    else if (a == "--reps") reps = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--causal") causals = std::string(argv[i + 1]) == "both" ? std::vector<int>{0, 1} : std::vector<int>{std::atoi(argv[i + 1])};
    else if (a == "--dtype") dtype = std::string(argv[i + 1]) == "fp16" ? flash3::DType::kFloat16 : flash3::DType::kBFloat16;
    else if (a == "--json") json_path = argv[i + 1];
    else if (a == "--ablation") ablation = std::atoi(argv[i + 1]) != 0;
    else if (a == "--variant") variant = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "flash3_bench: unknown option %s\n", a.c_str()); return 1; }
  }
  std::string why;
  if (!flash3::hopper_available(&why)) {
    std::printf("flash3_bench: no Hopper GPU: %s\n", why.c_str());
    return 2;
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  // One buffer set sized for the largest problem (4 x 8448 tokens x 2048 hidden), filled with
  // random values, reused by every point (each point reads all of q, k, v it uses).
  const size_t tokens = 16384, hidden = 2048, n = size_t(4) * 8448 * hidden;  // ablation's size
  std::vector<uint16_t> host(n);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& x : host) x = bf16_bits(normal(rng));  // same bits pattern is a valid fp16 spread
  void *q, *k, *v, *out, *lse;
  check(cudaMalloc(&q, n * 2), "cudaMalloc");
  check(cudaMalloc(&k, n * 2), "cudaMalloc");
  check(cudaMalloc(&v, n * 2), "cudaMalloc");
  check(cudaMalloc(&out, n * 2), "cudaMalloc");
  check(cudaMalloc(&lse, n / 64 * 4), "cudaMalloc");
  check(cudaMemcpy(q, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  for (auto& x : host) x = bf16_bits(normal(rng));
  check(cudaMemcpy(k, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  for (auto& x : host) x = bf16_bits(normal(rng));
  check(cudaMemcpy(v, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  if (dtype == flash3::DType::kFloat16) {
    // bf16 bit patterns read as fp16 can be huge or NaN: refill with fp16-safe values.
    std::uniform_int_distribution<int> mant(0, 1023), expo(12, 15);
    std::bernoulli_distribution sign;
    for (void* p : {q, k, v}) {
      for (auto& x : host) x = uint16_t((sign(rng) << 15) | (expo(rng) << 10) | mant(rng));
      check(cudaMemcpy(p, host.data(), n * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }

  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  // Median time of one forward call in ms (3 warm-ups, `reps` timed runs); -1 on error.
  auto time_ms = [&](const flash3::FwdArgs& args, flash3::detail::FwdAblation ablation) -> double {
    std::vector<float> ms(reps);
    try {
      for (int i = 0; i < 3; ++i) flash3::detail::fwd_ablation(args, ablation);
      for (int i = 0; i < reps; ++i) {
        check(cudaEventRecord(start), "cudaEventRecord");
        flash3::detail::fwd_ablation(args, ablation);
        check(cudaEventRecord(stop), "cudaEventRecord");
        check(cudaEventSynchronize(stop), "cudaEventSynchronize");
        check(cudaEventElapsedTime(&ms[i], start, stop), "cudaEventElapsedTime");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "flash3_bench: %s\n", e.what());
      return -1;
    }
    std::sort(ms.begin(), ms.end());
    return ms[reps / 2];
  };
  if (ablation) {
    const int b = 4, s = 8448, h = 16, d = 128;
    const double flops = 4.0 * b * h * double(s) * s * d;
    const struct { flash3::detail::FwdAblation v; const char* name; } rows[] = {
        {flash3::detail::FwdAblation::kDefault, "flash3 (all techniques)"},
        {flash3::detail::FwdAblation::kNoOverlap, "no GEMM-softmax pipelining"},
        {flash3::detail::FwdAblation::kNoPingpong, "no pingpong"},
        {flash3::detail::FwdAblation::kNoPersistent, "no persistent scheduler"},
        {flash3::detail::FwdAblation::kThreeStage, "3-stage pipeline (App. B.3, N=96)"},
        {flash3::detail::FwdAblation::kTwoStageBlockN96, "2-stage pipeline at N=96"},
    };
    std::printf("ablation (paper Table 2): batch %d, seqlen %d, %d heads, hdim %d, bf16, non-causal\n", b, s, h, d);
    FILE* json = json_path ? std::fopen(json_path, "w") : nullptr;
    if (json) std::fprintf(json, "{\"device\": \"%s\", \"ablation\": [\n", prop.name);
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); ++i) {
      flash3::FwdArgs args;
      args.q = flash3::TensorRef::contiguous(q, flash3::DType::kBFloat16, {b, s, h, d});
      args.k = args.q; args.k.data = k;
      args.v = args.q; args.v.data = v;
      args.out = args.q; args.out.data = out;
      if (flash3::detail::is_technique_ablation(rows[i].v) && !flash3::detail::fwd_ablations_built()) {
        std::printf("%-30s (not built: configure with -DFLASH3_BUILD_ABLATIONS=ON)\n", rows[i].name);
        continue;
      }
      const double med = time_ms(args, rows[i].v);
      if (med < 0) return 1;
      std::printf("%-30s %8.3f ms %8.1f TFLOP/s\n", rows[i].name, med, flops / (med * 1e-3) / 1e12);
      if (json) std::fprintf(json, "%s  {\"config\": \"%s\", \"ms\": %.5f, \"tflops\": %.2f}", i ? ",\n" : "", rows[i].name, med, flops / (med * 1e-3) / 1e12);
    }
    if (json) { std::fprintf(json, "\n]}\n"); std::fclose(json); }
    return 0;
  }
  std::printf("%-5s %-6s %-7s %-5s %-6s %10s %10s\n", "hdim", "causal", "seqlen", "batch", "heads", "ms", "TFLOP/s");
  FILE* json = json_path ? std::fopen(json_path, "w") : nullptr;
  if (json) std::fprintf(json, "{\"device\": \"%s\", \"points\": [\n", prop.name);
  bool first = true;
  for (int d : hdims) {
    for (int causal : causals) {
      for (int s : seqlens) {
        const int b = int(tokens / s), h = int(hidden / d);
        flash3::FwdArgs args;
        args.q = flash3::TensorRef::contiguous(q, dtype, {b, s, h, d});
        args.k = flash3::TensorRef::contiguous(k, dtype, {b, s, h, d});
        args.v = flash3::TensorRef::contiguous(v, dtype, {b, s, h, d});
        args.out = flash3::TensorRef::contiguous(out, dtype, {b, s, h, d});
        args.lse = flash3::TensorRef::contiguous(lse, flash3::DType::kFloat32, {b, h, s});
        args.causal = causal != 0;
        const double med = time_ms(args, static_cast<flash3::detail::FwdAblation>(variant));
        if (med < 0) return 1;
        const double flops = 4.0 * b * h * double(s) * s * d / (causal ? 2.0 : 1.0);
        const double tflops = flops / (med * 1e-3) / 1e12;
        std::printf("%-5d %-6s %-7d %-5d %-6d %10.3f %10.1f\n", d, causal ? "yes" : "no", s, b, h, med, tflops);
        if (json) {
          std::fprintf(json, "%s  {\"hdim\": %d, \"causal\": %s, \"seqlen\": %d, \"batch\": %d, \"nheads\": %d, \"ms\": %.5f, \"tflops\": %.2f}",
                       first ? "" : ",\n", d, causal ? "true" : "false", s, b, h, med, tflops);
          first = false;
        }
      }
    }
  }
  if (json) { std::fprintf(json, "\n]}\n"); std::fclose(json); }
  return 0;
}
