// Tensor: a non-owning, strided view {ptr, shape, strides, dtype, device} (DESIGN §3).
// Owning happens in arenas only; a Tensor never frees anything.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "sparsetron/core/dtype.h"
#include "sparsetron/core/error.h"

namespace sparsetron {

enum class Device : uint8_t { CPU, CUDA };
const char* device_name(Device d);

constexpr int kMaxDims = 4;

struct Tensor {
    void* data = nullptr;
    DType dtype = DType::F32;
    Device device = Device::CPU;
    int ndim = 0;
    std::array<int64_t, kMaxDims> shape{};
    std::array<int64_t, kMaxDims> stride{};  // in elements

    Tensor() = default;
    // A row-major contiguous view.
    Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
           Device device = Device::CPU);

    int64_t size(int dim) const;
    int64_t numel() const;
    bool is_contiguous() const;
    bool defined() const { return data != nullptr; }

    template <typename T>
    T* ptr() const {
        ST_ASSERT(dtype == dtype_of<T>(), "tensor holds ", dtype_name(dtype), ", accessed as ",
                  dtype_name(dtype_of<T>()));
        return static_cast<T*>(data);
    }

    // A view of columns [begin, begin+count) of the last dimension (keeps the strides).
    Tensor narrow_last(int64_t begin, int64_t count) const;
    // Rows [begin, begin+count) of the first dimension.
    Tensor rows(int64_t begin, int64_t count) const;
    // Same data, new contiguous shape (requires a contiguous view).
    Tensor reshape(std::initializer_list<int64_t> new_shape) const;

    std::string describe() const;  // "fp32[4, 8] cpu"
};

}  // namespace sparsetron
