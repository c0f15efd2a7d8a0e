// A CPU stand-in for the CUDA built-ins that native/kvxfer_gpu.cu uses, so the kernels' own source
// runs (compiled by g++) on machines without a GPU: each thread of a block is an OS thread,
// __syncthreads is a std::barrier, warp shuffles go through a block-wide exchange array, and the
// blocks of a grid run one after another (so function-static "__shared__" arrays are per block).
//
// It checks the kernels' logic (indexing, reductions, tails, the CRC combine tree) against zlib;
// it does not model the GPU's memory system or timing (tools/gpu_check.py does that on a GPU).
#pragma once
#include <barrier>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct alignas(16) uint4 {  // as CUDA declares it: 16-byte loads need 16-byte alignment
    unsigned int x, y, z, w;
};
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }

namespace simt {
inline thread_local dim3 thread_index;
inline thread_local dim3 block_index;
inline dim3 block_dim;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<unsigned long long> exchange;
}  // namespace simt

#define threadIdx (simt::thread_index)
#define blockIdx (simt::block_index)
#define blockDim (simt::block_dim)

inline void __syncthreads() { simt::block_barrier->arrive_and_wait(); }

template <typename T>
inline T __shfl_down_sync(unsigned int /*mask*/, T value, unsigned int delta) {
    static_assert(sizeof(T) <= sizeof(unsigned long long));
    unsigned int tid = threadIdx.x;
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    simt::exchange[tid] = bits;
    __syncthreads();
    unsigned int lane = tid & 31u;
    unsigned long long got = bits;
    if (lane + delta < 32u && tid + delta < blockDim.x) got = simt::exchange[tid + delta];
    __syncthreads();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

namespace simt {
// Run body() as a grid of `grid` blocks of `block` threads.
template <typename Body>
void launch(unsigned int grid, unsigned int block, Body body) {
    std::barrier<> barrier(block);
    block_barrier = &barrier;
    block_dim = dim3{block, 1, 1};
    exchange.assign(block, 0);
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned int t = 0; t < block; t++) {
        threads.emplace_back([&, t] {
            thread_index = dim3{t, 1, 1};
            for (unsigned int b = 0; b < grid; b++) {
                block_index = dim3{b, 1, 1};
                body();
                barrier.arrive_and_wait();  // the next block starts when every thread left this one
            }
        });
    }
    for (auto& t : threads) t.join();
    block_barrier = nullptr;
}
}  // namespace simt

inline int atomicOr(int* address, int value) { return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST); }
