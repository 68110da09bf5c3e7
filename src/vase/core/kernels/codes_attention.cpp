// Decode attention read straight from vase's quantized store (vase.core.codes, the CPU kernel).
//
// One query token per row. Per (row, KV head): the quantized slots [0, L) (packed codes, float16 steps and minima
// per group of channels; a slot counts when qmask is set and its logical position is >= 0), then the full-precision
// store: P entries of the value guard (valid when their logical slot is below the row's quantization limit and holds
// a token) and the row's recent tokens (the first recent[b]). Keys were divided by per-channel factors before their
// quantization: the query is multiplied by them instead. Scores and the softmax in float32, online over blocks of 64
// entries (no buffer that grows with the cache); the store is split into chunks across threads, merged at the end.
// Codes are read as bit planes: channel i * PER + k of a byte-packed row is (byte[i] >> (BITS * k)) & MASK, so the
// inner loops run over contiguous bytes and vectorize.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float NEG = -1e30f;  // finite: the kernel is built with -ffast-math
constexpr int64_t BLK = 64;

template <int BITS>
inline void dequant_planes(const uint8_t* __restrict src, const at::Half* st, const at::Half* zr, int64_t dim,
                           int64_t groups, float* __restrict dst) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
  const int64_t bytes = dim / PER, per_group = bytes / groups;
  for (int64_t n = 0; n < groups; ++n) {
    const float s = static_cast<float>(st[n]), z = static_cast<float>(zr[n]);
    const uint8_t* __restrict b = src + n * per_group;
    for (int k = 0; k < PER; ++k) {
      float* __restrict o = dst + k * bytes + n * per_group;
      const int sh = BITS * k;
#pragma omp simd
      for (int64_t i = 0; i < per_group; ++i) o[i] = z + s * static_cast<float>((b[i] >> sh) & MASK);
    }
  }
}

struct Args {
  const float *q, *kf, *fk, *fv, *sinks;
  const uint8_t *kq, *vq;
  const at::Half *ks, *kz, *vs, *vz;
  const bool* qmask;
  const int64_t *pos, *prot, *qlimit, *recent;
  float* out;
  float scaling;
  int64_t B, H, G, D, DV, L, NG, P, F, CAP, S;
};

// softmax state of one (row, KV head, chunk): per query head its max, sum and output
struct State {
  std::vector<float> s, acc, m, l;
  State(int64_t G, int64_t DV) : s(G * BLK), acc(G * DV), m(G), l(G) {}
  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), NEG);
    std::fill(l.begin(), l.end(), 0.f);
  }
  // n valid entries: keys kr [n, D], values vr [n, DV], queries qq [G, D] in the same channel order
  void block(int64_t n, const float* kr, const float* vr, const float* qq, int64_t G, int64_t D, int64_t DV) {
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = qq + j * D;
      float* sj = s.data() + j * BLK;
      float bm = NEG;
      for (int64_t i = 0; i < n; ++i) {
        const float* k = kr + i * D;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t c = 0; c < D; ++c) d += qj[c] * k[c];
        sj[i] = d;
        bm = std::max(bm, d);
      }
      const float nm = std::max(m[j], bm);
      const float scale = std::exp(m[j] - nm);
      float* a = acc.data() + j * DV;
      if (scale != 1.f) {
#pragma omp simd
        for (int64_t c = 0; c < DV; ++c) a[c] *= scale;
        l[j] *= scale;
      }
      m[j] = nm;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        sj[i] = std::exp(sj[i] - nm);
        sum += sj[i];
      }
      l[j] += sum;
      for (int64_t i = 0; i < n; ++i) {
        const float p = sj[i];
        const float* v = vr + i * DV;
#pragma omp simd
        for (int64_t c = 0; c < DV; ++c) a[c] += p * v[c];
      }
    }
  }
};

template <int BITS>
void run(const Args& a) {
  constexpr int PER = 8 / BITS;
  const int64_t G = a.G, D = a.D, DV = a.DV, L = a.L, NG = a.NG, S = a.S;
  const int64_t DB = D / PER, DBV = DV / PER, LC = (L + S - 1) / S;
  std::vector<float> part(a.B * a.H * S * G * (DV + 2));
  at::parallel_for(0, a.B * a.H * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qc(G * D), qp(G * D), kb(BLK * D), vb(BLK * DV), tmp(G * DV);
    State st(G, DV);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / S, chunk = task % S, b = bh / a.H;
      const int64_t lo = chunk * LC, hi = std::min(L, lo + LC);
      // the scaled query in channel order (full-precision keys) and times the key channel factors in plane order
      for (int64_t j = 0; j < G; ++j)
        for (int64_t c = 0; c < D; ++c) {
          const float v = a.q[(bh * G + j) * D + c] * a.scaling;
          qc[j * D + c] = v;  // the full-precision keys are the keys themselves
          qp[j * D + (c % PER) * DB + c / PER] = v * a.kf[bh * D + c];  // the quantized ones were divided by f
        }
      st.reset();
      const int64_t* pos = a.pos + bh * a.CAP;
      for (int64_t t0 = lo; t0 < hi; t0 += BLK) {
        const int64_t nb = std::min(BLK, hi - t0);
        int64_t n = 0;
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t t = t0 + i, row = bh * L + t;
          if (!a.qmask[row] || pos[t] < 0) continue;
          dequant_planes<BITS>(a.kq + row * DB, a.ks + row * NG, a.kz + row * NG, D, NG, kb.data() + n * D);
          dequant_planes<BITS>(a.vq + row * DBV, a.vs + row * NG, a.vz + row * NG, DV, NG, vb.data() + n * DV);
          ++n;
        }
        if (n) st.block(n, kb.data(), vb.data(), qp.data(), G, D, DV);
      }
      // the values were summed in plane order: back to channel order
      for (int64_t j = 0; j < G; ++j)
        for (int64_t c = 0; c < DV; ++c) tmp[j * DV + c] = st.acc[j * DV + (c % PER) * DBV + c / PER];
      std::copy(tmp.begin(), tmp.end(), st.acc.begin());
      if (chunk == S - 1) {  // the full-precision store: the guard's entries, then the recent tokens
        const int64_t qlim = a.qlimit[b], rec = a.recent[b];
        for (int64_t t0 = 0; t0 < a.F; t0 += BLK) {
          const int64_t nb = std::min(BLK, a.F - t0);
          int64_t n = 0;
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t f = t0 + i, row = bh * a.F + f;
            bool ok;
            if (f < a.P) {
              const int64_t slot = a.prot[bh * a.P + f];
              ok = slot < qlim && slot < a.CAP && pos[slot] >= 0;
            } else {
              ok = f - a.P < rec;
            }
            if (!ok) continue;
            std::copy(a.fk + row * D, a.fk + (row + 1) * D, kb.data() + n * D);
            std::copy(a.fv + row * DV, a.fv + (row + 1) * DV, vb.data() + n * DV);
            ++n;
          }
          if (n) st.block(n, kb.data(), vb.data(), qc.data(), G, D, DV);
        }
      }
      float* pt = part.data() + task * G * (DV + 2);
      for (int64_t j = 0; j < G; ++j) {
        pt[j * (DV + 2)] = st.m[j];
        pt[j * (DV + 2) + 1] = st.l[j];
        std::copy(st.acc.begin() + j * DV, st.acc.begin() + (j + 1) * DV, pt + j * (DV + 2) + 2);
      }
    }
  });
  for (int64_t bh = 0; bh < a.B * a.H; ++bh) {
    const int64_t h = bh % a.H;
    float* ob = a.out + bh * G * DV;
    for (int64_t j = 0; j < G; ++j) {
      float mm = NEG;
      for (int64_t c = 0; c < S; ++c) mm = std::max(mm, part[((bh * S + c) * G + j) * (DV + 2)]);
      float denom = a.sinks != nullptr ? std::exp(a.sinks[h * G + j] - mm) : 0.f;
      std::fill(ob + j * DV, ob + (j + 1) * DV, 0.f);
      for (int64_t c = 0; c < S; ++c) {
        const float* pt = part.data() + ((bh * S + c) * G + j) * (DV + 2);
        if (pt[1] == 0.f) continue;
        const float w = std::exp(pt[0] - mm);
        denom += w * pt[1];
        for (int64_t d = 0; d < DV; ++d) ob[j * DV + d] += w * pt[2 + d];
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      for (int64_t d = 0; d < DV; ++d) ob[j * DV + d] *= inv;
    }
  }
}

}  // namespace

// query [B, H*G, D] float32; kf [B, H, D] float32; kq/vq [B, H, L, D*bits/8] uint8; ks, kz, vs, vz [B, H, L, NG]
// float16; qmask [B, H, L] bool; positions [B, H, CAP] int64; fk, fv [B, H, F, D] float32; protected [B, H, P] int64;
// qlimit, recent [B] int64; sinks [H*G] float32 or empty. Returns [B, H*G, DV] float32.
torch::Tensor codes_attention(torch::Tensor query, torch::Tensor kf, double scaling, torch::Tensor kq, torch::Tensor ks,
                              torch::Tensor kz, torch::Tensor vq, torch::Tensor vs, torch::Tensor vz,
                              torch::Tensor qmask, torch::Tensor positions, torch::Tensor fk, torch::Tensor fv,
                              torch::Tensor prot, torch::Tensor qlimit, torch::Tensor recent, torch::Tensor sinks,
                              int64_t bits) {
  Args a;
  a.B = kq.size(0);
  a.H = kq.size(1);
  a.L = kq.size(2);
  a.D = fk.size(3);
  a.DV = fv.size(3);
  a.G = query.size(1) / a.H;
  a.NG = ks.size(3);
  a.F = fk.size(2);
  a.P = prot.size(2);
  a.CAP = positions.size(2);
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.is_contiguous(), "query: contiguous float32");
  auto out = torch::empty({a.B, query.size(1), a.DV}, query.options());
  const int64_t threads = at::get_num_threads();
  a.S = std::max<int64_t>(1, std::min<int64_t>((2 * threads + a.B * a.H - 1) / (a.B * a.H), (a.L + 255) / 256));
  a.q = query.data_ptr<float>();
  a.kf = kf.data_ptr<float>();
  a.fk = fk.data_ptr<float>();
  a.fv = fv.data_ptr<float>();
  a.sinks = sinks.numel() > 0 ? sinks.data_ptr<float>() : nullptr;
  a.kq = kq.data_ptr<uint8_t>();
  a.vq = vq.data_ptr<uint8_t>();
  a.ks = ks.data_ptr<at::Half>();
  a.kz = kz.data_ptr<at::Half>();
  a.vs = vs.data_ptr<at::Half>();
  a.vz = vz.data_ptr<at::Half>();
  a.qmask = qmask.data_ptr<bool>();
  a.pos = positions.data_ptr<int64_t>();
  a.prot = prot.data_ptr<int64_t>();
  a.qlimit = qlimit.data_ptr<int64_t>();
  a.recent = recent.data_ptr<int64_t>();
  a.out = out.data_ptr<float>();
  a.scaling = static_cast<float>(scaling);
  if (bits == 8)
    run<8>(a);
  else if (bits == 4)
    run<4>(a);
  else
    run<2>(a);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("codes_attention", &codes_attention, "decode attention over quantized codes (vase.core.codes)");
}
