/* bestiary CPU kernels: the batch-1 / small-batch decode ops, one source for four builds.
 *
 * Built by bestiary.core.kernels.cpu.build (gcc -O3 -fopenmp and one ISA's flags) the first time they
 * are needed, loaded with ctypes. The ISA follows from the compiler's predefined macros:
 *
 *   BST_ISA 3  AVX-512 + AVX512_BF16 + AVX512_VNNI   BST_ISA 2, and where both operands are
 *                                                    bfloat16 (bf16 weights x bf16 inputs,
 *                                                    bf16 q . bf16 keys) vdpbf16ps dot products;
 *                                                    int8 weights x bf16 inputs: vpdpwssd (q16)
 *   BST_ISA 2  AVX-512 (F, BW, VL; with FMA, F16C)   16-float vectors, masked tails
 *   BST_ISA 1  AVX2 + FMA + F16C                     8-float vectors
 *   BST_ISA 0  scalar C (what the compiler makes of it for the baseline target)
 *
 * The vector code is written once against the thin `vf` / `vi` layer of vector.h (intrinsics per
 * ISA); where the two ISAs want different algorithms (the int4 GEMV), each has its own.
 * vdpbf16ps (BST_ISA 3) multiplies pairs of bfloat16 exactly (8-bit significands: the product
 * fits a float) and adds them to float32 accumulators, rounding each add (denormals flushed):
 * the sums the widening + FMA path forms, in another order. It runs only where both operands
 * already are bfloat16 (a bf16 engine's activations and weights / q and keys), so nothing is
 * rounded that the other builds keep: float32 inputs take the FMA path on every build.
 * Each op has a torch reference in bestiary.core.kernels.cpu.ops, and the tests compare every build
 * with it. Tensors are passed as raw pointers, contiguous, in these dtypes:
 *
 *   DT_F32 = 0   float
 *   DT_BF16 = 1  bfloat16 (uint16 bit pattern; rounding to nearest even, as torch)
 *   DT_I8 = 2    int8 weights, one float scale per output row
 *   DT_I4 = 3    int4 weights, two per byte (low nibble = even k), float scale s and s * zero
 *                per row and group of G input features
 *   DT_F8 = 4    float8 e4m3fn KV cache codes (DT_I8 too: int8 KV codes), x ~ code * scale
 *   DT_I4D = 5   DT_I4 in the dot layout (int4d_tile4_bf16): the AVX-512 + BF16 build only
 *   DT_I8T = 6   DT_I8 in row tiles (w_off): a tile's GEMV reads one sequential stream
 *   DT_BF16T = 7 DT_BF16 W [n, k] in the same row tiles (decode; the prefill GEMM untiles it)
 *   DT_F32T = 8  DT_F32 W [n, k] in the same row tiles
 *   DT_I8A8 = 9  DT_I8T tiles multiplied with int8 activations quantized on the fly (linear_a8.c)
 *   DT_I4A8 = 10 DT_I4 codes in quads (8 features of 8 rows a load) x int8 activations quantized on the fly
 *                (linear_w4a8.c)
 *   DT_I4Q = 11  DT_I4 codes in the same quads x float inputs (linear_int4q.c): W4A16 on the AVX2 build
 *
 * Threads: OpenMP, with the libgomp that torch already loaded (same soname), so there is one
 * thread pool in the process. Every op takes the number of threads to use.
 *
 * Sources: this file is the one translation unit (build.py compiles it alone: one compiler run, one
 * library). It #includes the shared headers and then each op family's part, in this order; a part uses
 * what the ones before it define, and the static inline helpers inline across parts as in one file:
 *
 *   common.h             ISA selection (BST_ISA), dtype codes, INLINE, bfloat16 <-> float, bst_isa
 *   vector.h             the vf / vi vector layer, vexp, to_f32 / from_f32, sum16v / dot_bf16
 *   linear_rows.c        GEMV over weight rows: f32 / bf16 / int8 (+ row tiles), q16, vdpbf16ps bf16
 *   linear_int4.c        int4 GEMV: the checkpoint layout (DT_I4) and the dot layout (DT_I4D)
 *   linear_cols.c        float weights held transposed (Wt [k, n]): column tiles
 *   linear_a8.c          int8 weights (row tiles) x int8 activations, per row and 64 features (DT_I8A8): vpdpbusd
 *   linear_w4a8.c        int4 weights (quads) x int8 activations (DT_I4A8): vpmaddubsw
 *   linear_int4q.c       int4 weights (quads) x float inputs (DT_I4Q): one load for 8 rows, no horizontal sums
 *   linear.c             bst_linear (picks the path, splits the threads), bst_dequantize
 *   kv_cache.c           KV cache codes (int8, e4m3fn), bst_kv_write
 *   attention_decode.c   bst_decode_attention over the paged pool
 *   attention_prefill.c  bst_prefill_attention (bfloat16, avx512bf16 build)
 *   argmax.c             bst_argmax_rows (greedy sampling)
 *   elementwise.c        bst_rms_norm, bst_rotary, bst_act_and_mul
 *   lora.c               bst_lora_rows
 *   plan.c               bst_run_plan / bst_run_plan_timed (a decode step in one call; last: it calls them all)
 *
 * build.py's cache key hashes every .c and .h file of this directory, so a change in any part rebuilds.
 */
#include "common.h"
#include "vector.h"

#include "linear_rows.c"
#include "linear_int4.c"
#include "linear_cols.c"
#include "linear_a8.c"
#include "linear_w4a8.c"
#include "linear_int4q.c"
#include "linear.c"
#include "kv_cache.c"
#include "attention_decode.c"
#include "attention_prefill.c"
#include "argmax.c"
#include "elementwise.c"
#include "lora.c"
#include "plan.c"
