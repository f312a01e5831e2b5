// One row of a call of the library's CausalAttention and ShortConv ops (their row table). A
// call's tokens are packed row after row; a row names the buffer slot it reads and writes, so
// rows of any lengths on any slots share a call, and a slot no row names is never touched.
#ifndef EDGE_LLM_KQUANT_ROW_H
#define EDGE_LLM_KQUANT_ROW_H

#include <stdint.h>

typedef struct {
  int64_t slot;           // the buffers' row (KV [N, kv, L, D], conv state [N, kernel-1, C])
  int64_t start;          // the position of its first token
  int64_t offset;         // its first token's index in the call's packed tokens
  int64_t length;         // its tokens (positions start .. start + length - 1)
  int64_t bidirectional;  // attention: 1 = its queries also see its own later keys
} elk_row;

#endif  // EDGE_LLM_KQUANT_ROW_H
