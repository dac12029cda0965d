//! Layout-independent initialization (SEMANTICS.md section 7): every element is drawn from a
//! counter-based generator keyed by `(seed, parameter name, element index)`, so a rank
//! generates exactly its shard and every layout starts from the same model.
//!
//! The generator is SplitMix64 (Steele, Lea and Flood 2014) applied to a key derived from
//! the seed and an FNV-1a hash of the name, offset by the element index; normals come from
//! the Box-Muller transform of two such draws.

/// How a parameter is initialized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// Every element this value (norm scales 1, biases 0).
    Const(f64),
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

/// A uniform in (0, 1] from 53 random bits.
fn uniform(bits: u64) -> f64 {
    ((bits >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// The stream of one parameter.
#[derive(Clone, Copy, Debug)]
pub struct ParamRng {
    key: u64,
}

impl ParamRng {
    /// The stream of parameter `name` under `seed`.
    pub fn new(seed: u64, name: &str) -> ParamRng {
        ParamRng { key: splitmix64(seed ^ splitmix64(fnv1a(name))) }
    }

    /// A standard normal for element `index` of the parameter (its row-major index in the
    /// full, unsharded tensor).
    pub fn normal(&self, index: u64) -> f64 {
        let u1 = uniform(splitmix64(self.key.wrapping_add(index.wrapping_mul(2))));
        let u2 = uniform(splitmix64(self.key.wrapping_add(index.wrapping_mul(2).wrapping_add(1))));
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

impl Init {
    /// The value of element `index` of parameter `name`.
    pub fn value(self, seed: u64, name: &str, index: u64) -> f64 {
        self.values(seed, name)(index)
    }

    /// The values of parameter `name` by element index: the same as [`Init::value`], with
    /// the name hashed once rather than once per element.
    pub fn values(self, seed: u64, name: &str) -> impl Fn(u64) -> f64 + use<> {
        let rng = ParamRng::new(seed, name);
        move |index| match self {
            Init::Const(c) => c,
            Init::Normal(std) => std * rng.normal(index),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_only_on_seed_name_and_index() {
        let a = Init::Normal(1.0).value(7, "model.layers.0.mlp.up_proj.weight", 123);
        let b = Init::Normal(1.0).value(7, "model.layers.0.mlp.up_proj.weight", 123);
        assert_eq!(a.to_bits(), b.to_bits());
        assert_ne!(a, Init::Normal(1.0).value(8, "model.layers.0.mlp.up_proj.weight", 123));
        assert_ne!(a, Init::Normal(1.0).value(7, "model.layers.1.mlp.up_proj.weight", 123));
        assert_eq!(Init::Const(1.0).value(7, "x", 5), 1.0);
    }

    #[test]
    fn normals_have_unit_variance() {
        let rng = ParamRng::new(1, "w");
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| rng.normal(i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.01, "mean {mean} var {var}");
    }
}
