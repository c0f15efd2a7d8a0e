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
// Compiled to PTX by tools/gen_ptx.py (kept in kvxfer/core/gpu/kvxfer_gpu.ptx); the driver JIT-compiles
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
// For a chunk starting at byte j with s = sum d and t = sum m*d (m = 0..15 within the chunk),
// its share of the second sum is (L - j) * s - t. The weight (L - j) mod 65521 is stepped down by
// the stride each round (no division in the loop); s and t are four byte dot products each.
// Bytes before the first 16-byte boundary and after the last whole chunk go one by one.
// Overflow: per round sb_pos grows by < 65521 * 4080 < 2^28, so 64-bit sums hold 2^36 rounds.

// c + the sum of the four byte products of a and b (PTX dp4a; plain C where the source runs on a CPU)
__device__ __forceinline__ u32 dot4(u32 a, u32 b, u32 c) {
#ifdef __CUDA_ARCH__
    u32 r;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#else
    for (int k = 0; k < 4; k++) c += ((a >> (8 * k)) & 0xffu) * ((b >> (8 * k)) & 0xffu);
    return c;
#endif
}

__device__ __forceinline__ void chunk_sums(uint4 v, u32* s, u32* t) {
    u32 ss = dot4(v.x, 0x01010101u, 0u);
    ss = dot4(v.y, 0x01010101u, ss);
    ss = dot4(v.z, 0x01010101u, ss);
    ss = dot4(v.w, 0x01010101u, ss);
    u32 tt = dot4(v.x, 0x03020100u, 0u);
    tt = dot4(v.y, 0x07060504u, tt);
    tt = dot4(v.z, 0x0b0a0908u, tt);
    tt = dot4(v.w, 0x0f0e0d0cu, tt);
    *s = ss;
    *t = tt;
}

// [head, vec_end) is the part of the item made of whole 16-byte chunks on 16-byte boundaries
__device__ __forceinline__ void vector_part(const u8* p, u64 L, u64* head, u64* vec_end) {
    u64 h = (16u - (((u64)p) & 15u)) & 15u;
    if (h > L) h = L;
    *head = h;
    *vec_end = h + ((L - h) & ~(u64)15);
}

extern "C" __global__ void adler32_items(const u64* bases, const u64* item_lens, const long long* pages,
                                         int npages, u32* out) {
    __shared__ u64 red_a[32];
    __shared__ u64 red_b[32];
    int item = blockIdx.x;
    const u8* p = item_ptr(bases, item_lens, pages, npages, item);
    u64 L = item_lens[item / npages];
    u64 head, vec_end;
    vector_part(p, L, &head, &vec_end);
    u64 sa = 0, sb_pos = 0, sb_neg = 0;
    u64 stride = (u64)blockDim.x * 16;
    u32 step = (u32)(stride % ADLER_MOD);
    u64 j = head + (u64)threadIdx.x * 16;
    u32 w = (u32)((L - (j < L ? j : L)) % ADLER_MOD);  // (L - j) mod 65521 for this thread's first chunk
    for (; j < vec_end; j += stride) {
        u32 s, t;
        chunk_sums(*(const uint4*)(p + j), &s, &t);
        sa += s;
        sb_pos += (u64)w * s;
        sb_neg += t;
        w = (w >= step) ? w - step : w + ADLER_MOD - step;
    }
    for (u64 k = threadIdx.x; k < head + (L - vec_end); k += blockDim.x) {  // the odd bytes
        u64 jj = k < head ? k : vec_end + (k - head);
        u64 d = p[jj];
        sa += d;
        sb_pos += ((L - jj) % ADLER_MOD) * d;
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
        for (int wp = 0; wp < (int)((blockDim.x + 31) / 32); wp++) {
            ta += red_a[wp];
            tb += red_b[wp];
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

__device__ __forceinline__ u32 crc_word(const u32* table, u32 c, u32 w) {  // four bytes, little-endian
    c = table[(c ^ w) & 0xffu] ^ (c >> 8);
    c = table[(c ^ (w >> 8)) & 0xffu] ^ (c >> 8);
    c = table[(c ^ (w >> 16)) & 0xffu] ^ (c >> 8);
    return table[(c ^ (w >> 24)) & 0xffu] ^ (c >> 8);
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
        if ((((u64)q) & 15u) == 0) {
            for (; k + 16 <= C; k += 16) {
                uint4 v = *(const uint4*)(q + k);
                c = crc_word(table, c, v.x);
                c = crc_word(table, c, v.y);
                c = crc_word(table, c, v.z);
                c = crc_word(table, c, v.w);
            }
        }
        if ((((u64)(q + k)) & 3u) == 0) {
            for (; k + 4 <= C; k += 4) c = crc_word(table, c, *(const u32*)(q + k));
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
        u64 head, vec_end;
        vector_part(p, L, &head, &vec_end);
        uint4 zero = make_uint4(0, 0, 0, 0);
        for (u64 j = head + (u64)threadIdx.x * 16; j < vec_end; j += (u64)blockDim.x * 16) *(uint4*)(p + j) = zero;
        for (u64 k = threadIdx.x; k < head + (L - vec_end); k += blockDim.x) p[k < head ? k : vec_end + (k - head)] = 0;
        return;
    }
    for (int k = threadIdx.x; k < noffsets[b]; k += blockDim.x) {
        u64 off = poison_offsets[b * max_offsets + k];
        for (int byte = 0; byte < 8; byte++) p[off + byte] = (u8)(pattern >> (8 * byte));
    }
}

// Which items still carry the poison pattern at one of their buffer's poison offsets: out[item] is
// 1 if any of them does, else 0 (a page nobody wrote since it was freed under the poison policy).

extern "C" __global__ void find_poison_items(const u64* bases, const u64* item_lens, const long long* pages,
                                             int npages, const u64* poison_offsets, const int* noffsets,
                                             int max_offsets, u64 pattern, u32* out) {
    __shared__ int found;
    int item = blockIdx.x;
    int b = item / npages;
    const u8* p = item_ptr(bases, item_lens, pages, npages, item);
    if (threadIdx.x == 0) found = 0;
    __syncthreads();
    for (int k = threadIdx.x; k < noffsets[b]; k += blockDim.x) {
        u64 off = poison_offsets[b * max_offsets + k];
        u64 word = 0;
        for (int byte = 0; byte < 8; byte++) word |= (u64)p[off + byte] << (8 * byte);
        if (word == pattern) atomicOr(&found, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) out[item] = (u32)found;
}

// ---------------------------------------------------------------------------------------------
// Copying runs between pages and a contiguous staging buffer on the device (the tcp transport's
// GPU path): the host splits runs into pieces of at most 64 KiB and passes, per piece,
// runs[3k] = source address, runs[3k + 1] = destination address, runs[3k + 2] = length.
// One block per piece: 16-byte copies when source and destination share 16-byte alignment,
// byte copies for the odd ends. One launch replaces a copy call per run.

extern "C" __global__ void copy_runs(const u64* runs, int npieces) {
    int piece = blockIdx.x;
    if (piece >= npieces) return;
    const u8* src = (const u8*)runs[3 * piece];
    u8* dst = (u8*)runs[3 * piece + 1];
    u64 L = runs[3 * piece + 2];
    u64 head = 0, vec_end = 0;
    if (((((u64)src) ^ ((u64)dst)) & 15u) == 0) vector_part(src, L, &head, &vec_end);
    for (u64 j = head + (u64)threadIdx.x * 16; j < vec_end; j += (u64)blockDim.x * 16)
        *(uint4*)(dst + j) = *(const uint4*)(src + j);
    for (u64 k = threadIdx.x; k < head + (L - vec_end); k += blockDim.x) {
        u64 j = k < head ? k : vec_end + (k - head);
        dst[j] = src[j];
    }
}
