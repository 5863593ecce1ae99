#include "sparsetron/core/dtype.h"

#include "sparsetron/core/error.h"

namespace sparsetron {

size_t dtype_size(DType t) {
    switch (t) {
        case DType::F32:
            return 4;
        case DType::F64:
            return 8;
        case DType::BF16:
            return 2;
        case DType::I32:
            return 4;
        case DType::I64:
            return 8;
        case DType::U8:
            return 1;
        case DType::F16:
            return 2;
        case DType::F8E4M3:
            return 1;
    }
    ST_ASSERT(false, "unknown dtype");
    return 0;
}

const char* dtype_name(DType t) {
    switch (t) {
        case DType::F32:
            return "fp32";
        case DType::F64:
            return "fp64";
        case DType::BF16:
            return "bf16";
        case DType::I32:
            return "int32";
        case DType::I64:
            return "int64";
        case DType::U8:
            return "uint8";
        case DType::F16:
            return "fp16";
        case DType::F8E4M3:
            return "fp8e4m3";
    }
    return "?";
}

const char* dtype_safetensors_name(DType t) {
    switch (t) {
        case DType::F32:
            return "F32";
        case DType::F64:
            return "F64";
        case DType::BF16:
            return "BF16";
        case DType::I32:
            return "I32";
        case DType::I64:
            return "I64";
        case DType::U8:
            return "U8";
        case DType::F16:
            return "F16";
        case DType::F8E4M3:
            return "F8_E4M3";
    }
    return "?";
}

DType dtype_from_safetensors(const std::string& name) {
    for (DType t :
         {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8, DType::F8E4M3}) {
        if (name == dtype_safetensors_name(t)) return t;
    }
    throw Error(cat("unsupported safetensors dtype '", name,
                    "' (expected one of F32, F64, BF16, I32, I64, U8, F8_E4M3)"));
}

}  // namespace sparsetron
