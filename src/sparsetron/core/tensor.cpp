#include "sparsetron/core/tensor.h"

#include <sstream>

namespace sparsetron {

const char* device_name(Device d) {
    return d == Device::CPU ? "cpu" : "cuda";
}

Tensor::Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_) {
    ST_ASSERT(shape_.size() >= 1 && shape_.size() <= kMaxDims, "rank ", shape_.size());
    ndim = static_cast<int>(shape_.size());
    int i = 0;
    for (int64_t s : shape_) shape[i++] = s;
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; --d) {
        stride[d] = st;
        st *= shape[d];
    }
}

int64_t Tensor::size(int dim) const {
    if (dim < 0) dim += ndim;
    ST_ASSERT(dim >= 0 && dim < ndim, "dim ", dim, " of ", describe());
    return shape[dim];
}

int64_t Tensor::numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
}

bool Tensor::is_contiguous() const {
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; --d) {
        if (shape[d] != 1 && stride[d] != st) return false;
        st *= shape[d];
    }
    return true;
}

Tensor Tensor::narrow_last(int64_t begin, int64_t count) const {
    ST_ASSERT(begin >= 0 && count >= 0 && begin + count <= shape[ndim - 1], "narrow ", begin, "+",
              count, " of ", describe());
    Tensor t = *this;
    t.data = static_cast<char*>(data) + begin * stride[ndim - 1] * dtype_size(dtype);
    t.shape[ndim - 1] = count;
    return t;
}

Tensor Tensor::rows(int64_t begin, int64_t count) const {
    ST_ASSERT(begin >= 0 && count >= 0 && begin + count <= shape[0], "rows ", begin, "+", count,
              " of ", describe());
    Tensor t = *this;
    t.data = static_cast<char*>(data) + begin * stride[0] * dtype_size(dtype);
    t.shape[0] = count;
    return t;
}

Tensor Tensor::reshape(std::initializer_list<int64_t> new_shape) const {
    ST_ASSERT(is_contiguous(), "reshape of a strided view ", describe());
    Tensor t(data, dtype, new_shape, device);
    ST_ASSERT(t.numel() == numel(), "reshape ", describe(), " to ", t.describe());
    return t;
}

std::string Tensor::describe() const {
    std::ostringstream os;
    os << dtype_name(dtype) << "[";
    for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
    os << "] " << device_name(device);
    return os.str();
}

}  // namespace sparsetron
