#include "sparsetron/cuda/cuda_session.h"
#include "sparsetron/cuda/libraries.h"

namespace sparsetron::cuda {

CudaSession::CudaSession() : libs_(std::make_unique<Libraries>()) {
    cudaStream_t stream = nullptr;
    ST_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ST_CUBLAS_CHECK(cublasLtCreate(&libs_->lt));
    ST_CUDA_CHECK(cudaMalloc(&libs_->workspace, libs_->workspace_bytes));
    ctx_.device = Device::CUDA;
    ctx_.stream = stream;
    ctx_.libs = libs_.get();
}

CudaSession::~CudaSession() {
    auto destroy = [](GemmPlan& p) {
        cublasLtMatrixLayoutDestroy(p.a);
        cublasLtMatrixLayoutDestroy(p.b);
        cublasLtMatrixLayoutDestroy(p.c);
        cublasLtMatmulDescDestroy(p.op);
    };
    for (auto& [key, p] : libs_->plans) destroy(p);
    for (auto& [key, p] : libs_->fp8_plans) destroy(p);
    cudaFree(libs_->workspace);
    cublasLtDestroy(libs_->lt);
    cudaStreamDestroy(static_cast<cudaStream_t>(ctx_.stream));
}

void CudaSession::synchronize() const {
    ST_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(ctx_.stream)));
}

std::vector<double> CudaSession::time_ms(const std::function<void()>& fn, int iters,
                                         int warmup) const {
    cudaStream_t s = static_cast<cudaStream_t>(ctx_.stream);
    for (int i = 0; i < warmup; ++i) fn();
    std::vector<cudaEvent_t> ev(2 * size_t(iters));
    for (auto& e : ev) ST_CUDA_CHECK(cudaEventCreate(&e));
    for (int i = 0; i < iters; ++i) {
        ST_CUDA_CHECK(cudaEventRecord(ev[2 * i], s));
        fn();
        ST_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s));
    }
    ST_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> out;
    for (int i = 0; i < iters; ++i) {
        float ms = 0;
        ST_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        out.push_back(ms);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return out;
}

size_t CudaSession::gemm_plans() const {
    return libs_->plans.size();
}

}  // namespace sparsetron::cuda
