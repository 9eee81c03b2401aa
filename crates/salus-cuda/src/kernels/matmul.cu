// ------------------------------------------------------------------------------------
// Matrix products of any dtype (the cuBLAS path takes f32, f16 and bf16).
// c[b, i, j] = beta * bias[i * s0 + j * s1] + alpha * sum_p a[b, i, p] * b[b, p, j].

extern "C" __global__ void matmul_naive(const MatmulArgs a) {
    GRID_LOOP(t, a.batch * a.n * a.m) {
        i64 j = t % a.m, i = (t / a.m) % a.n, bi = t / (a.m * a.n);
        double acc = 0.0;
        for (i64 p = 0; p < a.k; ++p)
            acc += ld(a.a, a.adt, (bi * a.n + i) * a.k + p) * ld(a.b, a.bdt, (bi * a.k + p) * a.m + j);
        double v = a.bias ? a.beta * ld(a.bias, a.biasdt, i * a.bias_s0 + j * a.bias_s1) + a.alpha * acc : a.alpha * acc;
        st(a.c, a.cdt, t, v);
    }
}

