// ------------------------------------------------------------------------------------
// Convolutions of 1 to 3 spatial dims (padded to 3 with size-1 dims), transposed or not,
// as direct sums. Not transposed: the input is "large", the output "small"; transposed:
// the reverse. Small position a and tap k meet large position a * stride - pad + k * dil.

__device__ void unravel3(i64 p, const i64* s, i64* c) {
    c[2] = p % s[2];
    c[1] = (p / s[2]) % s[1];
    c[0] = p / (s[1] * s[2]);
}

__device__ i64 plane3(const i64* s) { return s[0] * s[1] * s[2]; }

// Large position of small position sc and tap kc, or -1 outside.
__device__ i64 large_of(const ConvArgs& a, const i64* sc, const i64* kc, const i64* large) {
    i64 at = 0;
    for (int d = 0; d < 3; ++d) {
        i64 b = sc[d] * a.stride[d] - a.pad[d] + kc[d] * a.dil[d];
        if (b < 0 || b >= large[d]) return -1;
        at = at * large[d] + b;
    }
    return at;
}

// Small position whose tap kc meets large position lc, or -1 when none does.
__device__ i64 small_of(const ConvArgs& a, const i64* lc, const i64* kc, const i64* small) {
    i64 at = 0;
    for (int d = 0; d < 3; ++d) {
        i64 t = lc[d] + a.pad[d] - kc[d] * a.dil[d];
        if (t < 0 || t % a.stride[d] != 0) return -1;
        t /= a.stride[d];
        if (t >= small[d]) return -1;
        at = at * small[d] + t;
    }
    return at;
}

// Weight index of (input channel c, output channel o) at tap k.
__device__ i64 w_at(const ConvArgs& a, i64 c, i64 o, i64 k) {
    i64 kp = plane3(a.k3);
    if (a.transposed) return (c * a.cout_g + (o % a.cout_g)) * kp + k;
    return (o * a.cin_g + (c % a.cin_g)) * kp + k;
}

extern "C" __global__ void conv_fwd(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    GRID_LOOP(t, a.n * c_out * op) {
        i64 pos = t % op, o = (t / op) % c_out, n = t / (op * c_out), g = o / a.cout_g;
        i64 pc[3], kc[3];
        unravel3(pos, a.out3, pc);
        double acc = 0.0;
        for (i64 ci = 0; ci < a.cin_g; ++ci) {
            i64 c = g * a.cin_g + ci;
            for (i64 k = 0; k < kp; ++k) {
                unravel3(k, a.k3, kc);
                i64 xi = a.transposed ? small_of(a, pc, kc, a.in3) : large_of(a, pc, kc, a.in3);
                if (xi < 0) continue;
                acc += ld(a.x, a.xdt, (n * c_in + c) * ip + xi) * ld(a.w, a.wdt, w_at(a, c, o, k));
            }
        }
        if (a.bias) acc += ld(a.bias, a.bdt, o);
        st(a.y, a.ydt, t, acc);
    }
}

// grad_input into x from grad_output g.
extern "C" __global__ void conv_bwd_input(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    GRID_LOOP(t, a.n * c_in * ip) {
        i64 pos = t % ip, c = (t / ip) % c_in, n = t / (ip * c_in), g = c / a.cin_g;
        i64 pc[3], kc[3];
        unravel3(pos, a.in3, pc);
        double acc = 0.0;
        for (i64 co = 0; co < a.cout_g; ++co) {
            i64 o = g * a.cout_g + co;
            for (i64 k = 0; k < kp; ++k) {
                unravel3(k, a.k3, kc);
                i64 yi = a.transposed ? large_of(a, pc, kc, a.out3) : small_of(a, pc, kc, a.out3);
                if (yi < 0) continue;
                acc += ld(a.g, a.gdt, (n * c_out + o) * op + yi) * ld(a.w, a.wdt, w_at(a, c, o, k));
            }
        }
        st(a.x, a.xdt, t, acc);
    }
}

// grad_weight into w from grad_output g and input x.
extern "C" __global__ void conv_bwd_weight(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    i64 wn = a.transposed ? c_in * a.cout_g * kp : c_out * a.cin_g * kp;
    const i64* small = a.transposed ? a.in3 : a.out3;
    const i64* large = a.transposed ? a.out3 : a.in3;
    GRID_LOOP(t, wn) {
        i64 k = t % kp, c, o;
        if (a.transposed) {
            c = t / (a.cout_g * kp);
            o = (c / a.cin_g) * a.cout_g + (t / kp) % a.cout_g;
        } else {
            o = t / (a.cin_g * kp);
            c = (o / a.cout_g) * a.cin_g + (t / kp) % a.cin_g;
        }
        i64 kc[3], sc[3];
        unravel3(k, a.k3, kc);
        double acc = 0.0;
        for (i64 n = 0; n < a.n; ++n) {
            for (i64 s = 0; s < plane3(small); ++s) {
                unravel3(s, small, sc);
                i64 l = large_of(a, sc, kc, large);
                if (l < 0) continue;
                i64 xi = a.transposed ? s : l, yi = a.transposed ? l : s;
                acc += ld(a.g, a.gdt, (n * c_out + o) * op + yi) * ld(a.x, a.xdt, (n * c_in + c) * ip + xi);
            }
        }
        st(a.w, a.wdt, t, acc);
    }
}

// Unfolds images [n0, n0 + count) of group g of a 2-d input into col[count][K][L] (f32),
// K = cin_g * kh * kw, L = oh * ow.
extern "C" __global__ void im2col(const Im2colArgs a) {
    i64 K = a.cin_g * a.kh * a.kw, L = a.oh * a.ow;
    GRID_LOOP(t, a.count * K * L) {
        i64 l = t % L, kk = (t / L) % K, img = t / (K * L);
        i64 kx = kk % a.kw, ky = (kk / a.kw) % a.kh, ci = kk / (a.kw * a.kh);
        i64 ox = l % a.ow, oy = l / a.ow;
        i64 iy = oy * a.sh - a.ph + ky * a.dh, ix = ox * a.sw - a.pw + kx * a.dw;
        float v = 0.0f;
        if (iy >= 0 && iy < a.h && ix >= 0 && ix < a.w)
            v = ((const float*)a.x)[(((a.n0 + img) * a.c_in + a.g * a.cin_g + ci) * a.h + iy) * a.w + ix];
        ((float*)a.col)[t] = v;
    }
}

// Folds col[count][K][L] back into grad_input (f32), adding: the gather form, one thread per
// input element, so no atomics are needed.
extern "C" __global__ void col2im(const Im2colArgs a) {
    i64 K = a.cin_g * a.kh * a.kw, L = a.oh * a.ow;
    i64 plane = a.h * a.w;
    GRID_LOOP(t, a.count * a.cin_g * plane) {
        i64 ix = t % a.w, iy = (t / a.w) % a.h, ci = (t / plane) % a.cin_g, img = t / (plane * a.cin_g);
        float acc = 0.0f;
        for (i64 ky = 0; ky < a.kh; ++ky) {
            i64 ty = iy + a.ph - ky * a.dh;
            if (ty < 0 || ty % a.sh != 0 || ty / a.sh >= a.oh) continue;
            for (i64 kx = 0; kx < a.kw; ++kx) {
                i64 tx = ix + a.pw - kx * a.dw;
                if (tx < 0 || tx % a.sw != 0 || tx / a.sw >= a.ow) continue;
                i64 kk = (ci * a.kh + ky) * a.kw + kx, l = (ty / a.sh) * a.ow + tx / a.sw;
                acc += ((const float*)a.col)[(img * K + kk) * L + l];
            }
        }
        ((float*)a.x)[(((a.n0 + img) * a.c_in + a.g * a.cin_g + ci) * a.h + iy) * a.w + ix] = acc;
    }
}

