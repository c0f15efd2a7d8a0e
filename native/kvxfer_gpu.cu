// GPU kernels of kvxfer: per-item checksums and page scrubbing, over a request's page list.
//
// An "item" is one page of one buffer: item (b, i) starts at bases[b] + pages[i] * item_lens[b]
// and is item_lens[b] bytes long; items are numbered b * npages + i (buffer-major, the canonical
// order of kvxfer.checksum). Each kernel runs one thread block per item.
//
// Checksums are bit-identical to zlib's: out[item] is adler32(item, 1) or crc32(item, 0) of the
// item's bytes; the host combines them into the request checksum exactly as it combines per-page
// checksums taken on the CPU (kvxfer.checksum.combine).
//
// Compiled to PTX by tools/gen_ptx.py (kept in kvxfer/gpu/kvxfer_gpu.ptx); the driver JIT-compiles
// it for the GPU at hand, so no compiler is needed where kvxfer runs.

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define ADLER_MOD 65521u
#define CRC_POLY 0xedb88320u

__device__ __forceinline__ const u8* item_ptr(const u64* bases, const u64* item_lens, const long long* pages,
                                              int npages, int item) {
    int b = item / npages;
    int i = item - b * npages;
    return (const u8*)(bases[b] + (u64)pages[i] * item_lens[b]);
}

// ---------------------------------------------------------------------------------------------
// Adler-32. For bytes d_0..d_{L-1} from the initial value 1:
//   A = 1 + sum d_k,   B = L + sum (L - k) d_k   (mod 65521)
// Both sums are linear in the bytes, so threads take strided 16-byte chunks and a block reduces.
// For a chunk starting at byte j with s = sum d and t = sum k*d (k = 0..15 within the chunk),
// its share of the second sum is (L - j) * s - t.

__device__ __forceinline__ void chunk_sums(uint4 v, u64* s, u64* t) {
    u32 words[4] = {v.x, v.y, v.z, v.w};
    u64 ss = 0, tt = 0;
#pragma unroll
    for (int w = 0; w < 4; w++) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 d = (words[w] >> (8 * k)) & 0xffu;
            ss += d;
            tt += (u64)(4 * w + k) * d;
        }
    }
    *s = ss;
    *t = tt;
}

extern "C" __global__ void adler32_items(const u64* bases, const u64* item_lens, const long long* pages,
                                         int npages, u32* out) {
    __shared__ u64 red_a[32];
    __shared__ u64 red_b[32];
    int item = blockIdx.x;
    const u8* p = item_ptr(bases, item_lens, pages, npages, item);
    u64 L = item_lens[item / npages];
    u64 sa = 0, sb_pos = 0, sb_neg = 0;
    u64 vec_end = ((((u64)p) & 15u) == 0) ? (L & ~(u64)15) : 0;  // the aligned 16-byte part
    int rounds = 0;
    for (u64 j = (u64)threadIdx.x * 16; j < vec_end; j += (u64)blockDim.x * 16) {
        uint4 v = *(const uint4*)(p + j);
        u64 s, t;
        chunk_sums(v, &s, &t);
        sa += s;
        sb_pos += ((L - j) % ADLER_MOD) * s;
        sb_neg += t;
        if (++rounds == 4096) {  // keep the 64-bit sums far from overflow
            sa %= ADLER_MOD;
            sb_pos %= ADLER_MOD;
            sb_neg %= ADLER_MOD;
            rounds = 0;
        }
    }
    for (u64 j = vec_end + threadIdx.x; j < L; j += blockDim.x) {  // the unaligned rest, byte by byte
        u64 d = p[j];
        sa += d;
        sb_pos += ((L - j) % ADLER_MOD) * d;
    }
    u64 a = sa % ADLER_MOD;
    u64 b = (sb_pos % ADLER_MOD + ADLER_MOD - sb_neg % ADLER_MOD) % ADLER_MOD;
    for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, off);
        b += __shfl_down_sync(0xffffffffu, b, off);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        red_a[warp] = a % ADLER_MOD;
        red_b[warp] = b % ADLER_MOD;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 ta = 0, tb = 0;
        for (int w = 0; w < (int)((blockDim.x + 31) / 32); w++) {
            ta += red_a[w];
            tb += red_b[w];
        }
        u32 A = (u32)((1 + ta) % ADLER_MOD);
        u32 B = (u32)((L % ADLER_MOD + tb) % ADLER_MOD);
        out[item] = (B << 16) | A;
    }
}

// ---------------------------------------------------------------------------------------------
// CRC-32 (zlib's: reflected, polynomial 0xedb88320, init and final xor 0xffffffff).
// Thread t computes crc32 of its own chunk of C = L / T bytes (T threads, L % T == 0, chosen by the
// host per buffer); a tree then joins neighbours: crc(X || Y) = mul(x^(8|Y|), crc(X)) ^ crc(Y),
// multiplication in GF(2)[x] mod the polynomial. The host passes x^(8 * C * 2^level) for each level
// (shift_ops[b * 32 + level]) so the kernel never computes powers.

__device__ __forceinline__ u32 gf2_mulmod(u32 a, u32 b) {  // reflected bit order: bit 31 is x^0
    u32 product = 0;
    for (u32 m = 1u << 31; m != 0; m >>= 1) {
        if (a & m) product ^= b;
        b = (b & 1u) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return product;
}

extern "C" __global__ void crc32_items(const u64* bases, const u64* item_lens, const long long* pages,
                                       int npages, const int* threads_per_item, const u32* shift_ops,
                                       u32* out) {
    __shared__ u32 table[256];
    __shared__ u32 partial[1024];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = (u32)i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ CRC_POLY : c >> 1;
        table[i] = c;
    }
    __syncthreads();
    int item = blockIdx.x;
    int b = item / npages;
    const u8* p = item_ptr(bases, item_lens, pages, npages, item);
    u64 L = item_lens[b];
    int T = threads_per_item[b];  // a power of two <= blockDim.x dividing L
    if ((int)threadIdx.x < T) {
        u64 C = L / (u64)T;
        const u8* q = p + (u64)threadIdx.x * C;
        u32 c = 0xffffffffu;
        u64 k = 0;
        if ((((u64)q) & 3u) == 0) {
            for (; k + 4 <= C; k += 4) {
                u32 w = *(const u32*)(q + k);
                c = table[(c ^ w) & 0xffu] ^ (c >> 8);
                c = table[(c ^ (w >> 8)) & 0xffu] ^ (c >> 8);
                c = table[(c ^ (w >> 16)) & 0xffu] ^ (c >> 8);
                c = table[(c ^ (w >> 24)) & 0xffu] ^ (c >> 8);
            }
        }
        for (; k < C; k++) c = table[(c ^ q[k]) & 0xffu] ^ (c >> 8);
        partial[threadIdx.x] = c ^ 0xffffffffu;
    }
    __syncthreads();
    int level = 0;
    for (int width = 1; width < T; width <<= 1, level++) {
        int left = (int)threadIdx.x * 2 * width;
        if (left + width < T) {
            partial[left] = gf2_mulmod(shift_ops[b * 32 + level], partial[left]) ^ partial[left + width];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[item] = partial[0];
}

// ---------------------------------------------------------------------------------------------
// Scrubbing freed pages. mode 0: zero every byte of every item. mode 1: write the 8-byte poison
// pattern at each of the noffsets offsets (per buffer: poison_offsets[b * max_offsets + k]).

extern "C" __global__ void scrub_items(const u64* bases, const u64* item_lens, const long long* pages, int npages,
                                       int mode, const u64* poison_offsets, const int* noffsets, int max_offsets,
                                       u64 pattern) {
    int item = blockIdx.x;
    int b = item / npages;
    u8* p = (u8*)item_ptr(bases, item_lens, pages, npages, item);
    u64 L = item_lens[b];
    if (mode == 0) {
        u64 vec_end = ((((u64)p) & 15u) == 0) ? (L & ~(u64)15) : 0;
        uint4 zero = make_uint4(0, 0, 0, 0);
        for (u64 j = (u64)threadIdx.x * 16; j < vec_end; j += (u64)blockDim.x * 16) *(uint4*)(p + j) = zero;
        for (u64 j = vec_end + threadIdx.x; j < L; j += blockDim.x) p[j] = 0;
        return;
    }
    for (int k = threadIdx.x; k < noffsets[b]; k += blockDim.x) {
        u64 off = poison_offsets[b * max_offsets + k];
        for (int byte = 0; byte < 8; byte++) p[off + byte] = (u8)(pattern >> (8 * byte));
    }
}
