/*
 * The assertion macro of the C unit tests (test_native.c, test_geometry.c):
 * CHECK(cond, fmt, ...) counts a pass, or counts a failure and prints where
 * and why. Each test program defines `passed` and `failed` and prints them.
 */
#ifndef GC_CHECK_H
#define GC_CHECK_H

#include <stdio.h>

static int passed, failed;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) {                                                                       \
            passed++;                                                                     \
        } else {                                                                          \
            failed++;                                                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                          \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fputc('\n', stderr);                                                          \
        }                                                                                 \
    } while (0)

#endif /* GC_CHECK_H */
