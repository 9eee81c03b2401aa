// Host-compiler stand-ins for the CUDA built-ins the kernels use, so that a C++ compiler can
// check the kernels' source (generated prelude and kernel files) for syntax, names and types
// where there is no NVRTC: see `abi::tests::the_kernel_source_compiles_as_host_cpp`.
#include <cmath>
#define __global__
#define __device__
#define __shared__ static
struct dim3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
extern dim3 blockIdx, threadIdx, blockDim, gridDim;
float __uint_as_float(unsigned);
unsigned __float_as_uint(float);
unsigned __float2uint_rn(float);
double __longlong_as_double(long long);
float atomicAdd(float*, float);
unsigned long long atomicAdd(unsigned long long*, unsigned long long);
int atomicAdd(int*, int);
unsigned atomicCAS(unsigned*, unsigned, unsigned);
unsigned long long atomicCAS(unsigned long long*, unsigned long long, unsigned long long);
void __threadfence();
float __int_as_float(int);
float __shfl_xor_sync(unsigned, float, int);
double __shfl_xor_sync(unsigned, double, int);
float __shfl_sync(unsigned, float, int);
void __syncthreads();
using std::isnan; using std::fmax; using std::fmin; using std::fabs; using std::exp; using std::log; using std::sqrt; using std::tanh; using std::erf; using std::pow; using std::log1p; using std::expm1;
