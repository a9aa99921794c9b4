// What libkvferry.so exports: the public API, nothing else.
//
// The library is compiled with hidden visibility (-fvisibility=hidden, inlines hidden: see
// kvferry_layer in src/CMakeLists.txt). Each public header declares its API between
//   #pragma GCC visibility push(default)   ...   #pragma GCC visibility pop
// (after its includes), so every class and function declared in include/kvferry/ is exported and
// nothing declared only in src/ is. Types a public class names only as an implementation detail
// (a pimpl's Impl, internal state behind a handle) are declared KVFERRY_HIDDEN so that their
// members stay inside the library. The test `symbols.exports_only_public_api` checks the result.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define KVFERRY_HIDDEN __attribute__((visibility("hidden")))
#else
#define KVFERRY_HIDDEN
#endif
