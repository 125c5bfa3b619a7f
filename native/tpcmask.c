/*
 * duetserve TPC-mask shim: write the CUDA driver's per-stream TPC mask.
 *
 * The driver keeps, inside its private stream object, a field {uint32 enabled; uint32 mask[4]}
 * (128 bits, low word first; a set bit disables that TPC). The object is the first pointer
 * stored at the address a CUstream handle points to; the field's byte offset depends on the
 * driver version and is passed in by the caller (duetserve/partition/tpcmask.py holds the
 * table). A wrong offset writes into driver memory: callers must validate with a %smid probe.
 */
#include <stdint.h>
#include <string.h>

struct duet_tpc_mask {
    uint32_t enabled;
    uint32_t disabled_tpcs[4];
};

static struct duet_tpc_mask *field(void *stream, uint32_t offset) {
    if (stream == 0) return 0;
    char *object = *(char **)stream;
    return object ? (struct duet_tpc_mask *)(object + offset) : 0;
}

/* Disable the TPCs whose bits are set in disabled[0..3]; returns 0, or -1 for a null stream. */
int duet_set_stream_tpc_mask(void *stream, uint32_t offset, const uint32_t disabled[4]) {
    struct duet_tpc_mask *m = field(stream, offset);
    if (!m) return -1;
    memcpy(m->disabled_tpcs, disabled, sizeof m->disabled_tpcs);
    m->enabled = 1;
    return 0;
}

/* Copy the current field (enabled flag, then the 4 mask words) into out[0..4]. */
int duet_get_stream_tpc_mask(void *stream, uint32_t offset, uint32_t out[5]) {
    struct duet_tpc_mask *m = field(stream, offset);
    if (!m) return -1;
    out[0] = m->enabled;
    memcpy(out + 1, m->disabled_tpcs, sizeof m->disabled_tpcs);
    return 0;
}
