// cuBLASLt, loaded at its first use: the engine defines the cuBLASLt entry points it calls and
// forwards each to the library opened with dlopen the first time one is called. Linking the
// library instead would load its 540 MB at every start of every binary (about a third of a second
// each, for `--help`, `plan`, CPU training and every test process alike).
//
// Each definition is checked against cublasLt.h's declaration (a mismatch does not compile), the
// definitions stay inside the engine (hidden visibility), and a machine without the library gets
// a named error at the first GEMM, not at startup.
#include <dlfcn.h>

#include <cublasLt.h>

#include <mutex>
#include <string>

#include "sparsetron/core/error.h"

namespace sparsetron::cuda {
namespace {

#define ST_LT_STR2(x) #x
#define ST_LT_STR(x) ST_LT_STR2(x)

// The library of the toolkit the engine was built against: by soname (the loader's search path:
// LD_LIBRARY_PATH, the system's libraries), then in the toolkit's directory at build time.
void* cublaslt_library() {
    static void* handle = [] {
        const std::string soname = "libcublasLt.so." ST_LT_STR(CUBLAS_VER_MAJOR);
        void* h = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
        std::string first_error = h ? "" : ::dlerror();
        if (!h)
            h = ::dlopen((std::string(SPARSETRON_CUBLASLT_DIR "/") + soname).c_str(),
                         RTLD_NOW | RTLD_LOCAL);
        ST_CHECK(h, "cannot load cuBLASLt (", soname, "): ", first_error, "; install the CUDA ",
                 CUBLAS_VER_MAJOR, " libraries or put their directory on LD_LIBRARY_PATH");
        return h;
    }();
    return handle;
}

template <typename Fn>
Fn resolve(const char* name) {
    void* symbol = ::dlsym(cublaslt_library(), name);
    ST_CHECK(symbol, "cuBLASLt has no ", name, " (", ::dlerror(), ")");
    return reinterpret_cast<Fn>(symbol);
}

}  // namespace
}  // namespace sparsetron::cuda

// Each entry point: a definition with cublasLt.h's signature that resolves the real function
// once and calls it.
#define ST_LT_FORWARD(ret, name, params, args)                                        \
    ret name params {                                                                 \
        static const auto real = sparsetron::cuda::resolve<decltype(&::name)>(#name); \
        return real args;                                                             \
    }

extern "C" {

ST_LT_FORWARD(cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * handle), (handle))
ST_LT_FORWARD(cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t handle), (handle))
ST_LT_FORWARD(const char*, cublasLtGetStatusString, (cublasStatus_t status), (status))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmul,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
               cublasLtMatrixLayout_t a_desc, const void* b, cublasLtMatrixLayout_t b_desc,
               const void* beta, const void* c, cublasLtMatrixLayout_t c_desc, void* d,
               cublasLtMatrixLayout_t d_desc, const cublasLtMatmulAlgo_t* algo, void* workspace,
               size_t workspace_bytes, cudaStream_t stream),
              (handle, desc, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc, algo,
               workspace, workspace_bytes, stream))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescCreate,
              (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
              (desc, compute, scale))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulDescSetAttribute,
              (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
               size_t bytes),
              (desc, attr, buf, bytes))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutCreate,
              (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols,
               int64_t ld),
              (layout, type, rows, cols, ld))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout),
              (layout))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutSetAttribute,
              (cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr, const void* buf,
               size_t bytes),
              (layout, attr, buf, bytes))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref),
              (pref))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref),
              (pref))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,
              (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
               const void* buf, size_t bytes),
              (pref, attr, buf, bytes))
ST_LT_FORWARD(cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
               cublasLtMatmulPreference_t pref, int requested,
               cublasLtMatmulHeuristicResult_t results[], int* returned),
              (handle, desc, a, b, c, d, pref, requested, results, returned))

}  // extern "C"
