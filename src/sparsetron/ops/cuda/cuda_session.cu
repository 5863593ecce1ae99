#include "sparsetron/ops/cuda/cuda_session.h"
#include "sparsetron/ops/cuda/libraries.h"

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
    for (auto& [key, p] : libs_->plans) {
        cublasLtMatrixLayoutDestroy(p.a);
        cublasLtMatrixLayoutDestroy(p.b);
        cublasLtMatrixLayoutDestroy(p.c);
        cublasLtMatmulDescDestroy(p.op);
    }
    cudaFree(libs_->workspace);
    cublasLtDestroy(libs_->lt);
    cudaStreamDestroy(static_cast<cudaStream_t>(ctx_.stream));
}

void CudaSession::synchronize() const {
    ST_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(ctx_.stream)));
}

size_t CudaSession::gemm_plans() const {
    return libs_->plans.size();
}

}  // namespace sparsetron::cuda
