/*
 * acme_kernels.h: the public interface of the Acme NPU kernels (libacme_kernels.so.1).
 *
 * This library stands for a vendor's closed kernels: in a real product it is shipped as a
 * binary, and only this header is public. The 1bit route (src/kernels.rs) loads it at run time
 * with dlopen and resolves these symbols by name; it is never linked against it.
 *
 * Every function is thread-safe: none keeps state between calls.
 */
#ifndef ACME_KERNELS_H
#define ACME_KERNELS_H

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden: only what is marked here is exported. */
#define ACME_API __attribute__((visibility("default")))

/* The version of the kernels, "MAJOR.MINOR.PATCH": this build is "1.0.3". The string is
 * static; never free it. */
ACME_API const char *acme_kernels_version(void);

/* Errors acme_generate returns (always below 0). */
#define ACME_ERR_NULL (-1)     /* prompt or out is NULL */
#define ACME_ERR_TOO_SMALL (-2) /* out_len cannot hold the token and its NUL */

/* The deterministic "token generator": token number `step` (from 0) of the reply to `prompt`,
 * a NUL-terminated UTF-8 string. The reply is the prompt's words (runs of bytes other than
 * ASCII white space) in reverse order, one word per step; every token after the first starts
 * with one space, so the tokens concatenated are the reversed sentence.
 *
 * Writes the token and a NUL into `out` (at most `out_len` bytes, which strlen(prompt) + 2
 * always suffices for) and returns its length in bytes (> 0); returns 0 when the reply has no
 * token `step` (the reply is complete), writing an empty string when out_len allows; returns an
 * ACME_ERR_* value (< 0) on error. */
ACME_API int acme_generate(const char *prompt, unsigned step, char *out, unsigned out_len);

/* The size of the device's own memory in bytes (the Acme NPU has 4 GiB). */
ACME_API unsigned long long acme_device_total_bytes(void);

#ifdef __cplusplus
}
#endif

#endif /* ACME_KERNELS_H */
