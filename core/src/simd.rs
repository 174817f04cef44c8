//! Sixteen bytes side by side ([`U8x16`]): the few lane-wise operations that the block
//! scans use (the JSON string scans of [`crate::json_scan`], the byte classes and lane-wise
//! counters of the token tally in [`crate::estimate`]), each written once over this type.
//!
//! Two bodies, chosen at compile time, with no runtime detection:
//! - Wasm SIMD (`core::arch::wasm32`, `simd128`), which the workspace's
//!   `.cargo/config.toml` enables for `wasm32-wasip1`: the filter's `.wasm`;
//! - SSE2, part of the x86-64 baseline, so every x86-64 build has it: native builds
//!   (tests, benchmarks, the control plane, a native filter). Through the `safe_arch`
//!   crate: `core::arch::x86_64`'s intrinsics are safe to call only from functions marked
//!   `#[target_feature(enable = "sse2")]`, a build's `-C target-feature` does not count
//!   (rustc 1.95, E0133), so calling them here would take `unsafe`, which the workspace
//!   denies; `safe_arch` wraps each one behind `#[cfg(target_feature = "sse2")]`.
//!
//! Elsewhere (aarch64 included: NEON is not written, as nothing here can run its tests)
//! the module is not built and the callers take their portable paths (SWAR on a `u64`,
//! byte loops).
//!
//! A block is built from its two little-endian `u64` halves, not loaded through a pointer
//! (no `unsafe`); LLVM turns that into one unaligned 16-byte load (`movdqu` on x86-64,
//! `v128.load` on Wasm).
//!
//! The operations are those both instruction sets have, or that SSE2 builds from two:
//! unsigned `<` (SSE2 compares bytes as signed only: both sides are XOR-ed with 0x80,
//! which maps unsigned order onto signed order; the constant side folds), and the shift by
//! one lane with a byte put in lane 0.

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
use core::arch::wasm32 as arch;
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
use safe_arch as arch;

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
type Raw = arch::v128;
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
type Raw = arch::m128i;

/// Sixteen bytes, lane *k* being byte *k* of the block. The comparisons give lane masks:
/// each lane 0xFF where it holds, 0x00 where not.
#[derive(Clone, Copy)]
pub(crate) struct U8x16(Raw);

impl U8x16 {
    /// The bytes of `block`, byte *k* in lane *k*.
    #[inline(always)]
    pub(crate) fn new(block: &[u8; 16]) -> Self {
        let w = u128::from_le_bytes(*block);
        let (lo, hi) = (w as u64, (w >> 64) as u64);
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::u64x2(lo, hi))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::set_i64_m128i(hi as i64, lo as i64))
        }
    }

    /// `b` in every lane.
    #[inline(always)]
    pub(crate) fn splat(b: u8) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::u8x16_splat(b))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::set_splat_i8_m128i(b as i8))
        }
    }

    /// Lanes equal to `other`'s.
    #[inline(always)]
    pub(crate) fn eq(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::u8x16_eq(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::cmp_eq_mask_i8_m128i(self.0, other.0))
        }
    }

    /// Lanes below `other`'s, as unsigned bytes.
    #[inline(always)]
    pub(crate) fn lt(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::u8x16_lt(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            // x ↦ x ^ 0x80 maps 0..=255 onto -128..=127 in order.
            let bias = arch::set_splat_i8_m128i(i8::MIN);
            Self(arch::cmp_lt_mask_i8_m128i(
                arch::bitxor_m128i(self.0, bias),
                arch::bitxor_m128i(other.0, bias),
            ))
        }
    }

    /// Lane-wise `self - other`, wrapping.
    #[inline(always)]
    pub(crate) fn wrapping_sub(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::u8x16_sub(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::sub_i8_m128i(self.0, other.0))
        }
    }

    /// `self & !other`.
    #[inline(always)]
    pub(crate) fn and_not(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::v128_andnot(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            // `bitandnot_m128i(a, b)` is `!a & b`.
            Self(arch::bitandnot_m128i(other.0, self.0))
        }
    }

    /// Whether any lane of a lane mask is set (on Wasm any bit: the same for masks).
    #[inline(always)]
    pub(crate) fn any(self) -> bool {
        #[cfg(target_arch = "wasm32")]
        {
            arch::v128_any_true(self.0)
        }
        #[cfg(target_arch = "x86_64")]
        {
            arch::move_mask_i8_m128i(self.0) != 0
        }
    }

    /// Bit *k* set when lane *k*'s high bit is (for a lane mask: when lane *k* is set).
    #[inline(always)]
    pub(crate) fn bitmask(self) -> u32 {
        #[cfg(target_arch = "wasm32")]
        {
            u32::from(arch::u8x16_bitmask(self.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            // 16 bits, zero-extended: never negative.
            arch::move_mask_i8_m128i(self.0) as u32
        }
    }

    /// The sum of the sixteen lanes as unsigned bytes (0..=4080): the population count of
    /// per-lane counters (the tally's, [`crate::estimate`]). SSE2's `psadbw` against zero
    /// (two sums of eight lanes), or Wasm's pairwise widening adds.
    #[inline(always)]
    pub(crate) fn sum(self) -> u32 {
        #[cfg(target_arch = "wasm32")]
        {
            let d = arch::u32x4_extadd_pairwise_u16x8(arch::u16x8_extadd_pairwise_u8x16(self.0));
            arch::u32x4_extract_lane::<0>(d)
                + arch::u32x4_extract_lane::<1>(d)
                + arch::u32x4_extract_lane::<2>(d)
                + arch::u32x4_extract_lane::<3>(d)
        }
        #[cfg(target_arch = "x86_64")]
        {
            let [lo, hi]: [u64; 2] =
                arch::sum_of_u8_abs_diff_m128i(self.0, arch::zeroed_m128i()).into();
            // Each half is at most 8 × 255.
            (lo + hi) as u32
        }
    }

    /// Lane *k* is lane *k* − 1 of `self`; lane 0 is `first`.
    #[inline(always)]
    pub(crate) fn shift_in(self, first: u8) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::i8x16_shuffle::<
                0,
                16,
                17,
                18,
                19,
                20,
                21,
                22,
                23,
                24,
                25,
                26,
                27,
                28,
                29,
                30,
            >(arch::u8x16_splat(first), self.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            // The byte shift fills lane 0 with zero; `first` goes in by or.
            Self(arch::bitor_m128i(
                arch::byte_shl_imm_u128_m128i::<1>(self.0),
                arch::set_i32_m128i_s(i32::from(first)),
            ))
        }
    }
}

impl std::ops::BitOr for U8x16 {
    type Output = Self;
    #[inline(always)]
    fn bitor(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::v128_or(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::bitor_m128i(self.0, other.0))
        }
    }
}

impl std::ops::BitAnd for U8x16 {
    type Output = Self;
    #[inline(always)]
    fn bitand(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::v128_and(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::bitand_m128i(self.0, other.0))
        }
    }
}

impl std::ops::BitXor for U8x16 {
    type Output = Self;
    #[inline(always)]
    fn bitxor(self, other: Self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::v128_xor(self.0, other.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::bitxor_m128i(self.0, other.0))
        }
    }
}

impl std::ops::Not for U8x16 {
    type Output = Self;
    #[inline(always)]
    fn not(self) -> Self {
        #[cfg(target_arch = "wasm32")]
        {
            Self(arch::v128_not(self.0))
        }
        #[cfg(target_arch = "x86_64")]
        {
            Self(arch::bitxor_m128i(self.0, arch::set_splat_i8_m128i(-1)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Each operation against its definition, lane by lane, on arbitrary blocks.
        #[test]
        fn each_operation_is_its_lane_wise_definition(
            a in proptest::array::uniform16(proptest::num::u8::ANY),
            b in proptest::array::uniform16(proptest::num::u8::ANY),
            first in proptest::num::u8::ANY,
        ) {
            let lanes = |v: U8x16| -> [u8; 16] {
                let mut out = [0u8; 16];
                let bits = v.bitmask();
                // The mask results are 0x00 or 0xFF: rebuild them from their bits.
                for (k, o) in out.iter_mut().enumerate() {
                    *o = if (bits >> k) & 1 == 1 { 0xFF } else { 0 };
                }
                out
            };
            let mask = |f: &dyn Fn(u8, u8) -> bool| -> [u8; 16] {
                std::array::from_fn(|k| if f(a[k], b[k]) { 0xFF } else { 0 })
            };
            let (va, vb) = (U8x16::new(&a), U8x16::new(&b));
            proptest::prop_assert_eq!(lanes(va.eq(vb)), mask(&|x, y| x == y));
            proptest::prop_assert_eq!(lanes(va.lt(vb)), mask(&|x, y| x < y));
            proptest::prop_assert_eq!(va.bitmask(), a.iter().enumerate().map(|(k, &x)| u32::from(x >> 7) << k).sum::<u32>());
            proptest::prop_assert_eq!(va.any(), a.iter().any(|&x| x >= 0x80));
            // Values, through their high bits and through equality with a rebuilt block.
            let same = |v: U8x16, want: [u8; 16]| v.eq(U8x16::new(&want)).bitmask() == 0xFFFF;
            proptest::prop_assert!(same(va.wrapping_sub(vb), std::array::from_fn(|k| a[k].wrapping_sub(b[k]))));
            proptest::prop_assert!(same(va.and_not(vb), std::array::from_fn(|k| a[k] & !b[k])));
            proptest::prop_assert!(same(va | vb, std::array::from_fn(|k| a[k] | b[k])));
            proptest::prop_assert!(same(va & vb, std::array::from_fn(|k| a[k] & b[k])));
            proptest::prop_assert!(same(va ^ vb, std::array::from_fn(|k| a[k] ^ b[k])));
            proptest::prop_assert!(same(!va, a.map(|x| !x)));
            proptest::prop_assert!(same(U8x16::splat(first), [first; 16]));
            proptest::prop_assert_eq!(va.sum(), a.iter().map(|&x| u32::from(x)).sum::<u32>());
            let shifted: [u8; 16] = std::array::from_fn(|k| k.checked_sub(1).map_or(first, |j| a[j]));
            proptest::prop_assert!(same(va.shift_in(first), shifted));
        }
    }
}
