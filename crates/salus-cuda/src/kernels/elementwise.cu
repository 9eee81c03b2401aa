// ------------------------------------------------------------------------------------
// Elementwise ops and strided copies.

// The gamma family (the CPU device's salus-cpu kernels/special.rs, the same series): the
// Bernoulli numbers B2..B24, digamma by reflection, recurrence and its asymptotic series,
// and polygamma through the Hurwitz zeta function (direct sum, then Euler-Maclaurin).
__device__ const double BERNOULLI[12] = {
    1.0 / 6.0, -1.0 / 30.0, 1.0 / 42.0, -1.0 / 30.0, 5.0 / 66.0, -691.0 / 2730.0, 7.0 / 6.0,
    -3617.0 / 510.0, 43867.0 / 798.0, -174611.0 / 330.0, 854513.0 / 138.0,
    -236364091.0 / 2730.0};

__device__ double digamma_of(double x) {
    const double pi = 3.14159265358979323846;
    if (x == 0.0) return 1.0 / x < 0.0 ? -NEG_INF : NEG_INF;
    double shift = 0.0;
    if (x < 0.0) {
        if (x == trunc(x)) return QUIET_NAN;
        shift = -pi / tan(pi * (x - trunc(x)));
        x = 1.0 - x;
    }
    while (x < 10.0) {
        shift -= 1.0 / x;
        x += 1.0;
    }
    double z = 1.0 / (x * x), series = 0.0, power = 1.0;
    for (int k = 0; k < 7; ++k) {
        power *= z;
        series += BERNOULLI[k] / (2.0 * (k + 1)) * power;
    }
    return shift + log(x) - 0.5 / x - series;
}

__device__ double hurwitz_zeta(double s, double q) {
    if (isnan(q) || isnan(s)) return QUIET_NAN;
    if (q <= 0.0 && q == floor(q)) return -NEG_INF;
    double sum = pow(q, -s), a = q, last = sum;
    for (int terms = 0; terms < 9 || a <= 9.0;) {
        ++terms;
        a += 1.0;
        last = pow(a, -s);
        sum += last;
        if (fabs(last / sum) < 1.1102230246251565e-16) return sum;
    }
    sum += last * a / (s - 1.0) - 0.5 * last;
    double rising = 1.0, power = last, factorial = 1.0;
    for (int j = 0; j < 12; ++j) {
        double k = 2.0 * j;
        rising *= s + k;
        power /= a;
        factorial *= (k + 1.0) * (k + 2.0);
        double term = BERNOULLI[j] / factorial * rising * power;
        sum += term;
        if (fabs(term / sum) < 1.1102230246251565e-16) break;
        rising *= s + k + 1.0;
        power /= a;
    }
    return sum;
}

__device__ double polygamma_of(i64 n, double x) {
    if (n == 0) return digamma_of(x);
    double factorial = 1.0;
    for (i64 k = 2; k <= n; ++k) factorial *= (double)k;
    return (n % 2 == 1 ? 1.0 : -1.0) * factorial * hurwitz_zeta((double)(n + 1), x);
}

// erf^-1 (the CPU device's special.rs): Winitzki's approximation, then Newton steps on
// erf(y) - |x|, on (1 - |x|) - erfc(y) past 1/2.
__device__ double erfinv_of(double x) {
    const double pi = 3.14159265358979323846;
    double t = fabs(x);
    if (isnan(t) || t > 1.0) return QUIET_NAN;
    if (t == 1.0) return x < 0.0 ? NEG_INF : -NEG_INF;
    double a = 0.147, lg = log(1.0 - t * t), first = 2.0 / (pi * a) + lg / 2.0;
    double y = sqrt(sqrt(first * first - lg / a) - first);
    for (int k = 0; k < 6; ++k) {
        double residual = t <= 0.5 ? erf(y) - t : (1.0 - t) - erfc(y);
        double step = residual / (2.0 / sqrt(pi) * exp(-y * y));
        y -= step;
        if (fabs(step) <= 2.220446049250313e-16 * fabs(y)) break;
    }
    return x < 0.0 ? -y : y;
}

__device__ double apply(i64 op, double a, double b, double c, double s0, double s1, i64 i) {
    switch (op) {
        case OP_COPY: return a;
        case OP_ADD: return a + s0 * b;
        case OP_MUL: return a * b;
        case OP_DIV: return a / b;
        case OP_ADDS: return a + s0;
        case OP_MULS: return a * s0;
        case OP_DIVS: return a / s0;
        case OP_NEG: return -a;
        case OP_ABS: return fabs(a);
        case OP_SIGN: return isnan(a) ? a : (a > 0.0 ? 1.0 : (a < 0.0 ? -1.0 : 0.0));
        case OP_EXP: return exp(a);
        case OP_LOG: return log(a);
        case OP_SQRT: return sqrt(a);
        case OP_RSQRT: return 1.0 / sqrt(a);
        case OP_SIGMOID: return 1.0 / (1.0 + exp(-a));
        case OP_TANH: return tanh(a);
        case OP_RELU: return isnan(a) ? a : fmax(a, 0.0);
        case OP_LEAKY: return a > 0.0 ? a : s0 * a;
        case OP_GELU_TANH:
            return 0.5 * a * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (a + 0.044715 * a * a * a)));
        case OP_GELU: return 0.5 * a * (1.0 + erf(a / 1.41421356237309504880));
        case OP_ERF: return erf(a);
        case OP_ERFC: return erfc(a);
        case OP_ERFINV: return erfinv_of(a);
        case OP_LGAMMA: return lgamma(a);
        case OP_DIGAMMA: return digamma_of(a);
        case OP_POLYGAMMA: return polygamma_of((i64)s0, a);
        case OP_LOG1P: return log1p(a);
        case OP_EXPM1: return expm1(a);
        case OP_SIN: return sin(a);
        case OP_COS: return cos(a);
        case OP_FLOOR: return floor(a);
        case OP_CEIL: return ceil(a);
        case OP_ROUND: return rint(a);
        case OP_TRUNC: return trunc(a);
        case OP_ATAN: return atan(a);
        case OP_ATAN2: return atan2(a, b);
        case OP_REMAINDER: {
            double m = fmod(a, b);
            return (m != 0.0 && ((b < 0.0) != (m < 0.0))) ? m + b : m;
        }
        case OP_FMOD: return fmod(a, b);
        case OP_POW_TS: return pow(a, s0);
        case OP_POW_TT: return pow(a, b);
        case OP_POW_S: return pow(s0, a);
        case OP_CLAMP: return isnan(a) ? a : fmin(fmax(a, s0), s1);
        case OP_EQ: return a == s0 ? 1.0 : 0.0;
        case OP_NE: return a != s0 ? 1.0 : 0.0;
        case OP_LT: return a < s0 ? 1.0 : 0.0;
        case OP_LE: return a <= s0 ? 1.0 : 0.0;
        case OP_GT: return a > s0 ? 1.0 : 0.0;
        case OP_GE: return a >= s0 ? 1.0 : 0.0;
        case OP_LAND: return (a != 0.0 && b != 0.0) ? 1.0 : 0.0;
        case OP_LNOT: return a == 0.0 ? 1.0 : 0.0;
        case OP_BNOT: return (double)(~(i64)a);
        case OP_BAND: return (double)(((i64)a) & ((i64)b));
        case OP_WHERE: return a != 0.0 ? b : c;
        case OP_FILL: return s0;
        case OP_ARANGE: return s0 + s1 * (double)i;
        case OP_RECIPROCAL: return 1.0 / a;
        case OP_MAX: return (isnan(a) || isnan(b)) ? a + b : (a < b ? b : a);
        case OP_MIN: return (isnan(a) || isnan(b)) ? a + b : (b < a ? b : a);
        case OP_EQ_T: return a == b ? 1.0 : 0.0;
        case OP_LT_T: return a < b ? 1.0 : 0.0;
        case OP_GT_T: return a > b ? 1.0 : 0.0;
        default: return 0.0;
    }
}

// An operand's element of flat index `i` in the fast index modes: `(i / q) % m`, `q` 0
// for element 0, `m` 0 for no modulo; `narrow` (every index below 2^32) divides in 32 bits.
__device__ i64 fast_index(i64 i, i64 q, i64 m, bool narrow) {
    if (q == 0) return 0;
    if (narrow) {
        unsigned x = (unsigned)i;
        if (q != 1) x /= (unsigned)q;
        if (m != 0) x %= (unsigned)m;
        return (i64)x;
    }
    i64 x = i;
    if (q != 1) x /= q;
    if (m != 0) x %= m;
    return x;
}

// Four f32 elements from `4 j` of an operand contiguous with the output (`q` 1, 16-byte
// aligned), or its one element four times (`q` 0).
__device__ float4 ld4(u64 p, i64 q, i64 j) {
    if (q == 0) {
        float v = ((const float*)p)[0];
        float4 r;
        r.x = v;
        r.y = v;
        r.z = v;
        r.w = v;
        return r;
    }
    return ((const float4*)p)[j];
}

extern "C" __global__ void ew(const ElementwiseArgs a) {
    if (a.mode == IDX_FLAT4) {
        // Every operand f32, `n` a multiple of 4: the same loads, `apply` and rounding as
        // one element at a time, element `4 j + k` in lane k.
        float4 z;
        z.x = z.y = z.z = z.w = 0.0f;
        GRID_LOOP(j, a.n >> 2) {
            float4 v0 = a.nin > 0 ? ld4(a.inputs[0].ptr, a.inputs[0].q, j) : z;
            float4 v1 = a.nin > 1 ? ld4(a.inputs[1].ptr, a.inputs[1].q, j) : z;
            float4 v2 = a.nin > 2 ? ld4(a.inputs[2].ptr, a.inputs[2].q, j) : z;
            float4 r;
            r.x = (float)apply(a.op, (double)v0.x, (double)v1.x, (double)v2.x, a.s0, a.s1, 4 * j);
            r.y = (float)apply(a.op, (double)v0.y, (double)v1.y, (double)v2.y, a.s0, a.s1, 4 * j + 1);
            r.z = (float)apply(a.op, (double)v0.z, (double)v1.z, (double)v2.z, a.s0, a.s1, 4 * j + 2);
            r.w = (float)apply(a.op, (double)v0.w, (double)v1.w, (double)v2.w, a.s0, a.s1, 4 * j + 3);
            ((float4*)a.out.ptr)[j] = r;
        }
        return;
    }
    const bool narrow = a.n <= 0xffffffffLL;
    GRID_LOOP(i, a.n) {
        i64 o = i, x0 = i, x1 = i, x2 = i;
        if (a.mode == IDX_FLAT) {
            x0 = a.inputs[0].q != 0 ? i : 0;
            x1 = a.inputs[1].q != 0 ? i : 0;
            x2 = a.inputs[2].q != 0 ? i : 0;
        } else if (a.mode == IDX_BROADCAST) {
            x0 = fast_index(i, a.inputs[0].q, a.inputs[0].m, narrow);
            x1 = fast_index(i, a.inputs[1].q, a.inputs[1].m, narrow);
            x2 = fast_index(i, a.inputs[2].q, a.inputs[2].m, narrow);
        } else {
            o = x0 = x1 = x2 = 0;
            i64 r = i;
            for (int d = (int)a.rank - 1; d >= 0; --d) {
                i64 c = r % a.shape[d];
                r /= a.shape[d];
                o += c * a.out.st[d];
                x0 += c * a.inputs[0].st[d];
                x1 += c * a.inputs[1].st[d];
                x2 += c * a.inputs[2].st[d];
            }
        }
        if (a.op == OP_COPY && a.inputs[0].dt == a.out.dt) {
            raw(a.out.ptr, o, a.inputs[0].ptr, x0, a.out.dt);
            continue;
        }
        double v0 = a.nin > 0 ? ld(a.inputs[0].ptr, a.inputs[0].dt, x0) : 0.0;
        double v1 = a.nin > 1 ? ld(a.inputs[1].ptr, a.inputs[1].dt, x1) : 0.0;
        double v2 = a.nin > 2 ? ld(a.inputs[2].ptr, a.inputs[2].dt, x2) : 0.0;
        st(a.out.ptr, a.out.dt, o, apply(a.op, v0, v1, v2, a.s0, a.s1, i));
    }
}

