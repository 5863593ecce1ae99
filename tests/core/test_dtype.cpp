#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "sparsetron/core/dtype.h"

using namespace sparsetron;

TEST(Bf16, RoundsToNearestEven) {
    EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3F80);
    // 1 + 2^-8 lies exactly between 0x3F80 and 0x3F81: ties go to the even mantissa (0x3F80).
    EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f).bits, 0x3F80);
    // 1 + 3*2^-8 lies between 0x3F81 and 0x3F82: tie goes to even 0x3F82.
    EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f).bits, 0x3F82);
    // Just above the tie rounds up.
    EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f).bits, 0x3F81);
    EXPECT_EQ(float_to_bf16(-2.5f).bits, 0xC020);
}

TEST(Bf16, SpecialValues) {
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
    // A NaN whose payload sits only in the low bits must stay NaN, not become infinity.
    uint32_t low_nan = 0x7F800001u;
    float f;
    std::memcpy(&f, &low_nan, 4);
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
    EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::max()))));
    EXPECT_EQ(bf16_to_float(float_to_bf16(0.0f)), 0.0f);
}

TEST(Bf16, RoundTripErrorIsBounded) {
    for (int i = -2000; i <= 2000; ++i) {
        float x = static_cast<float>(i) * 0.37f + 0.001f;
        float y = bf16_to_float(float_to_bf16(x));
        EXPECT_LE(std::fabs(x - y), std::fabs(x) * 0x1p-8f) << x;
    }
}

TEST(DType, SizesAndSafetensorsNames) {
    EXPECT_EQ(dtype_size(DType::BF16), 2u);
    EXPECT_EQ(dtype_size(DType::I64), 8u);
    EXPECT_EQ(dtype_from_safetensors("BF16"), DType::BF16);
    // FP8 releases (DeepSeek-V3 / GLM) store e4m3 weights; loading dequantizes them.
    EXPECT_EQ(dtype_from_safetensors("F8_E4M3"), DType::F8E4M3);
    EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
    EXPECT_THROW(dtype_from_safetensors("F8_E5M2"), std::exception);
}
