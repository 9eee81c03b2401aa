//! Test tooling of salus's devices, not part of their API (never published): replaying
//! PyTorch reference runs on a device ([`reference`](mod@reference)), and the tests that
//! run more than one backend against the same references.
//!
//! Owns: the reference-run reader used by tests, examples (`replay_reference`,
//! `profile_reference`) and `salus-bench`; the op tests (`tests/ops.rs`: every op on the
//! CPU device, on GPU 0 with `SALUS_TEST_DEVICE=cuda`, or on the CUDA device's kernels run
//! on the host with `SALUS_TEST_DEVICE=cuda-emulated`) and the CUDA device's tests against
//! the CPU device (`tests/cuda.rs`: on GPU 0, else on `salus_cuda::Emulator`), with their
//! shared harness (`tests/common/mod.rs`). Must not touch: the devices themselves (`salus-exec`,
//! `salus-cpu`, `salus-cuda`): nothing here is a dependency of them or of `salusd`.

pub mod reference;
