/*
 * acme_kernels.c: the "closed" Acme NPU kernels of the vendor-route example. See
 * acme_kernels.h for the interface. A real vendor ships this as a binary; the example builds it
 * from source (build.rs) so that the route has something real to load.
 */
#include "acme_kernels.h"

#include <stddef.h>
#include <string.h>

/* -DACME_KERNELS_VERSION=\"x.y.z\" builds another version (the route's tests build one to see
 * start refuse it). */
#ifndef ACME_KERNELS_VERSION
#define ACME_KERNELS_VERSION "1.0.3"
#endif
#define ACME_DEVICE_TOTAL_BYTES (4ULL * 1024ULL * 1024ULL * 1024ULL)

const char *acme_kernels_version(void) { return ACME_KERNELS_VERSION; }

unsigned long long acme_device_total_bytes(void) { return ACME_DEVICE_TOTAL_BYTES; }

/* ASCII white space only: UTF-8 continuation and lead bytes are never white space, so words
 * keep their multi-byte characters whole. */
static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* Find word number `index` (from 0) of `text`: its start in *start and its length in *len.
 * Returns the number of words in `text` (so a call with an index past the end counts them). */
static size_t find_word(const char *text, size_t index, const char **start, size_t *len) {
    size_t count = 0;
    const unsigned char *p = (const unsigned char *)text;
    while (*p != '\0') {
        while (*p != '\0' && is_space(*p)) {
            p++;
        }
        if (*p == '\0') {
            break;
        }
        const unsigned char *word = p;
        while (*p != '\0' && !is_space(*p)) {
            p++;
        }
        if (count == index) {
            *start = (const char *)word;
            *len = (size_t)(p - word);
        }
        count++;
    }
    return count;
}

int acme_generate(const char *prompt, unsigned step, char *out, unsigned out_len) {
    if (prompt == NULL || out == NULL) {
        return ACME_ERR_NULL;
    }
    const char *unused_start = NULL;
    size_t unused_len = 0;
    size_t words = find_word(prompt, (size_t)-1, &unused_start, &unused_len);
    if ((size_t)step >= words) {
        if (out_len > 0) {
            out[0] = '\0';
        }
        return 0;
    }
    const char *start = NULL;
    size_t len = 0;
    find_word(prompt, words - 1 - (size_t)step, &start, &len);
    size_t lead = step > 0 ? 1 : 0;
    /* The token, its leading space and the NUL; a token too long for an int is refused too. */
    if (lead + len + 1 > (size_t)out_len || lead + len > 0x7fffffff) {
        return ACME_ERR_TOO_SMALL;
    }
    if (lead) {
        out[0] = ' ';
    }
    memcpy(out + lead, start, len);
    out[lead + len] = '\0';
    return (int)(lead + len);
}
