// Entry points (for ctypes) that run native/kvxfer_gpu.cu's kernels on the CPU through simt.h, with
// the same arguments kvxfer.gpu.kernels passes to cuLaunchKernel.
#include "simt.h"
#include "../../native/kvxfer_gpu.cu"

extern "C" {
void run_adler32_items(unsigned grid, unsigned block, const u64* bases, const u64* item_lens,
                       const long long* pages, int npages, u32* out) {
    simt::launch(grid, block, [&] { adler32_items(bases, item_lens, pages, npages, out); });
}

void run_crc32_items(unsigned grid, unsigned block, const u64* bases, const u64* item_lens, const long long* pages,
                     int npages, const int* threads_per_item, const u32* shift_ops, u32* out) {
    simt::launch(grid, block, [&] { crc32_items(bases, item_lens, pages, npages, threads_per_item, shift_ops, out); });
}

void run_scrub_items(unsigned grid, unsigned block, const u64* bases, const u64* item_lens, const long long* pages,
                     int npages, int mode, const u64* poison_offsets, const int* noffsets, int max_offsets,
                     u64 pattern) {
    simt::launch(grid, block, [&] {
        scrub_items(bases, item_lens, pages, npages, mode, poison_offsets, noffsets, max_offsets, pattern);
    });
}

void run_find_poison_items(unsigned grid, unsigned block, const u64* bases, const u64* item_lens,
                           const long long* pages, int npages, const u64* poison_offsets, const int* noffsets,
                           int max_offsets, u64 pattern, u32* out) {
    simt::launch(grid, block, [&] {
        find_poison_items(bases, item_lens, pages, npages, poison_offsets, noffsets, max_offsets, pattern, out);
    });
}

void run_copy_runs(unsigned grid, unsigned block, const u64* runs, int npieces) {
    simt::launch(grid, block, [&] { copy_runs(runs, npieces); });
}
}
