//! The workload catalog: the 15 models of the Salus evaluation, each at its three batch
//! sizes (Salus Table 3, dissertation Table A.1), 45 workloads in all.
//!
//! Every entry describes one training job as measured alone on the reference GPU (an
//! NVIDIA P100 with 16 GB, TensorFlow 1.5): its persistent memory (model and
//! framework-internal data, kept across iterations), its ephemeral memory (peak minus
//! persistent, allocated and freed within each iteration), the duration of one iteration
//! and the share of the GPU's compute it keeps busy.
//!
//! Byte counts are exact integers with decimal units, as the papers write them:
//! 1 MB = 10^6 bytes, 1 GB = 10^9 bytes, so the papers' "110.9 MB" is `110_900_000`.
//! Where the papers state a figure it is used as is; every other figure is derived, and
//! `docs/workloads.md` says how, column by column, and which entries carry which source.
//!
//! Workloads are named `<model>_<batch>`: `googlenet_25`, `seq2seq_small`.

/// One training workload: a model at one batch size, as measured alone on the reference GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workload {
    /// Model name as the papers spell it, lower case: `"googlenet"`.
    pub model: &'static str,
    /// Batch size: `"25"`, or `"small"`/`"medium"`/`"large"` for `seq2seq`.
    pub batch: &'static str,
    /// P: model and framework-internal memory, resident for the job's whole life (bytes).
    pub persistent_bytes: u64,
    /// E: peak memory minus persistent memory, needed only while an iteration runs (bytes).
    pub ephemeral_bytes: u64,
    /// Duration of one training iteration with the GPU to itself (seconds).
    pub iteration_s: f64,
    /// Share of the GPU's compute the job keeps busy when running alone, in (0, 1].
    pub compute_share: f64,
}

impl Workload {
    /// The workload's canonical name, `<model>_<batch>`: `"googlenet_25"`.
    pub fn name(&self) -> String {
        format!("{}_{}", self.model, self.batch)
    }
}

/// Memory of the reference GPU (NVIDIA P100, 16 GB) the catalog figures are for, in bytes.
///
/// The papers' "16 GB" read with the catalog's decimal units; the physical 16 GiB is a
/// little larger, so every fit judged against this figure also holds on the real card.
pub const REFERENCE_CAPACITY_BYTES: u64 = 16_000_000_000;

const fn w(
    model: &'static str,
    batch: &'static str,
    persistent_bytes: u64,
    ephemeral_bytes: u64,
    iteration_s: f64,
    compute_share: f64,
) -> Workload {
    Workload {
        model,
        batch,
        persistent_bytes,
        ephemeral_bytes,
        iteration_s,
        compute_share,
    }
}

/// The 45 workloads, in the order of Salus Table 3. Figures and their sources:
/// `docs/workloads.md`.
#[rustfmt::skip]
static CATALOG: [Workload; 45] = [
    // alexnet
    w("alexnet", "25", 764_117_400, 386_124_341, 0.0547, 0.42),
    w("alexnet", "50", 795_034_800, 807_982_058, 0.0569, 0.44),
    w("alexnet", "100", 856_869_600, 932_164_640, 0.0607, 0.48),
    // googlenet: persistent memory of googlenet_25 is the papers' 110.9 MB
    w("googlenet", "25", 110_900_000, 722_172_538, 0.0585, 0.81),
    w("googlenet", "50", 141_811_200, 1_379_966_054, 0.1002, 0.89),
    w("googlenet", "100", 202_022_400, 2_505_904_026, 0.1799, 0.94),
    // inception3
    w("inception3", "25", 339_240_600, 2_450_264_731, 0.1982, 0.89),
    w("inception3", "50", 392_881_200, 4_824_916_432, 0.3606, 0.94),
    w("inception3", "100", 500_162_400, 9_536_366_240, 0.6834, 0.97),
    // inception4
    w("inception4", "25", 566_040_600, 4_426_098_818, 0.4049, 0.88),
    w("inception4", "50", 619_681_200, 8_665_538_077, 0.7280, 0.93),
    w("inception4", "75", 673_321_800, 12_891_660_421, 1.0551, 0.95),
    // overfeat
    w("overfeat", "25", 1_782_816_600, 2_797_812_853, 0.1355, 0.43),
    w("overfeat", "50", 1_814_833_200, 2_934_826_704, 0.1431, 0.46),
    w("overfeat", "100", 1_878_866_400, 5_772_727_584, 0.1550, 0.50),
    // resnet50
    w("resnet50", "25", 337_305_600, 2_073_698_304, 0.1248, 0.88),
    w("resnet50", "50", 367_411_200, 4_037_459_968, 0.2261, 0.93),
    w("resnet50", "75", 397_516_800, 6_001_116_774, 0.3246, 0.95),
    // resnet101
    w("resnet101", "25", 564_105_600, 3_173_656_858, 0.2151, 0.92),
    w("resnet101", "50", 594_211_200, 6_160_828_698, 0.3808, 0.96),
    w("resnet101", "75", 624_316_800, 9_148_629_683, 0.5795, 0.97),
    // resnet152: resnet152_75 is the papers' 822.2 MB persistent and 13.8 GB peak
    w("resnet152", "25", 752_505_600, 4_496_550_042, 0.3083, 0.86),
    w("resnet152", "50", 782_611_200, 8_752_603_699, 0.5426, 0.92),
    w("resnet152", "75", 822_200_000, 12_977_800_000, 0.7839, 0.95),
    // vgg11
    w("vgg11", "25", 1_624_905_600, 5_311_529_498, 0.1732, 0.82),
    w("vgg11", "50", 1_655_011_200, 8_556_126_746, 0.3050, 0.90),
    w("vgg11", "100", 1_715_222_400, 11_716_616_730, 0.5452, 0.94),
    // vgg16
    w("vgg16", "25", 1_690_905_600, 5_244_690_637, 0.3003, 0.85),
    w("vgg16", "50", 1_721_011_200, 8_490_126_746, 0.5453, 0.92),
    w("vgg16", "100", 1_781_222_400, 11_810_734_285, 0.9980, 0.96),
    // vgg19
    w("vgg19", "25", 1_754_505_600, 5_181_090_637, 0.3582, 0.84),
    w("vgg19", "50", 1_784_611_200, 8_426_631_603, 0.6468, 0.91),
    w("vgg19", "100", 1_844_822_400, 11_314_491_827, 1.1730, 0.95),
    // vae: vae_256 peaks at the papers' 35 MB (TensorFlow measurement)
    w("vae", "64", 19_342_105, 4_605_263, 0.0066, 0.11),
    w("vae", "128", 20_263_158, 6_447_368, 0.0073, 0.13),
    w("vae", "256", 21_184_211, 13_815_789, 0.0086, 0.14),
    // superres
    w("superres", "32", 18_353_520, 265_072_640, 0.0199, 0.33),
    w("superres", "64", 33_230_192, 524_288_000, 0.0298, 0.38),
    w("superres", "128", 63_376_752, 1_041_215_748, 0.0497, 0.42),
    // speech
    w("speech", "25", 524_288_000, 1_845_493_760, 1.4000, 0.66),
    w("speech", "50", 524_288_000, 3_670_016_000, 2.0000, 0.76),
    w("speech", "75", 524_288_000, 5_494_538_240, 2.6000, 0.82),
    // seq2seq: the batch names the model size of the configuration
    w("seq2seq", "small", 18_874_368, 83_047_219, 0.0180, 0.15),
    w("seq2seq", "medium", 83_886_080, 1_084_479_242, 0.0450, 0.40),
    w("seq2seq", "large", 359_976_141, 5_422_396_211, 0.0950, 0.70),
];

/// All 45 workloads, in the order of Salus Table 3 (model by model, batch sizes ascending).
pub fn catalog() -> &'static [Workload] {
    &CATALOG
}

/// The workload of `model` at batch size `batch`, both spelled as in the catalog
/// (`lookup("googlenet", "25")`, `lookup("seq2seq", "small")`); `None` if there is none.
pub fn lookup(model: &str, batch: &str) -> Option<&'static Workload> {
    CATALOG
        .iter()
        .find(|workload| workload.model == model && workload.batch == batch)
}

/// The workload with canonical name `name` (`"resnet50_50"`, `"seq2seq_small"`); `None` if
/// there is none.
pub fn by_name(name: &str) -> Option<&'static Workload> {
    let (model, batch) = name.rsplit_once('_')?;
    lookup(model, batch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const MB: u64 = 1_000_000;
    const GB: u64 = 1_000_000_000;

    /// Salus Table 3: every model with its three batch sizes, in Table order.
    const TABLE_3: [(&str, [&str; 3]); 15] = [
        ("alexnet", ["25", "50", "100"]),
        ("googlenet", ["25", "50", "100"]),
        ("inception3", ["25", "50", "100"]),
        ("inception4", ["25", "50", "75"]),
        ("overfeat", ["25", "50", "100"]),
        ("resnet50", ["25", "50", "75"]),
        ("resnet101", ["25", "50", "75"]),
        ("resnet152", ["25", "50", "75"]),
        ("vgg11", ["25", "50", "100"]),
        ("vgg16", ["25", "50", "100"]),
        ("vgg19", ["25", "50", "100"]),
        ("vae", ["64", "128", "256"]),
        ("superres", ["32", "64", "128"]),
        ("speech", ["25", "50", "75"]),
        ("seq2seq", ["small", "medium", "large"]),
    ];

    fn get(name: &str) -> &'static Workload {
        by_name(name).unwrap_or_else(|| panic!("{name} is missing from the catalog"))
    }

    fn peak(workload: &Workload) -> u64 {
        workload.persistent_bytes + workload.ephemeral_bytes
    }

    #[test]
    fn has_45_workloads_with_unique_names() {
        assert_eq!(catalog().len(), 45);
        let names: HashSet<String> = catalog().iter().map(Workload::name).collect();
        assert_eq!(names.len(), 45);
    }

    #[test]
    fn follows_table_3_models_batches_and_order() {
        let expected: Vec<(&str, &str)> = TABLE_3
            .iter()
            .flat_map(|(model, batches)| batches.iter().map(move |batch| (*model, *batch)))
            .collect();
        let actual: Vec<(&str, &str)> = catalog().iter().map(|w| (w.model, w.batch)).collect();
        assert_eq!(actual, expected);
    }

    #[test]
    fn papers_figures_are_exact() {
        assert_eq!(get("googlenet_25").persistent_bytes, 110_900_000);
        let resnet152 = get("resnet152_75");
        assert_eq!(resnet152.persistent_bytes, 822_200_000);
        // 13.8 GB, the largest peak the papers report, at resnet152's largest batch.
        assert_eq!(peak(resnet152), 13_800_000_000);
        // vae peaks at 35 MB with a 22 MB average in TensorFlow: the average is never below
        // the persistent floor.
        let vae = get("vae_256");
        assert_eq!(peak(vae), 35 * MB);
        assert!(vae.persistent_bytes <= 22 * MB);
        assert_eq!(REFERENCE_CAPACITY_BYTES, 16 * GB);
    }

    #[test]
    fn resnet152_has_the_largest_peak_and_vae_is_below_1_gb() {
        let largest = catalog().iter().map(peak).max();
        assert_eq!(largest, Some(13_800_000_000));
        assert!(
            catalog()
                .iter()
                .filter(|w| w.model == "vae")
                .all(|w| peak(w) < GB)
        );
    }

    #[test]
    fn every_workload_fits_alone_on_the_reference_gpu() {
        for workload in catalog() {
            assert!(
                peak(workload) <= REFERENCE_CAPACITY_BYTES,
                "{} needs {} bytes",
                workload.name(),
                peak(workload)
            );
            assert!(workload.ephemeral_bytes > 0, "{}", workload.name());
            assert!(workload.persistent_bytes > 0, "{}", workload.name());
        }
    }

    #[test]
    fn memory_and_iteration_time_grow_with_batch_size() {
        for (model, batches) in TABLE_3 {
            for pair in batches.windows(2) {
                let smaller = lookup(model, pair[0]).unwrap_or_else(|| panic!("{model}"));
                let larger = lookup(model, pair[1]).unwrap_or_else(|| panic!("{model}"));
                let what = format!("{} -> {}", smaller.name(), larger.name());
                assert!(
                    smaller.persistent_bytes <= larger.persistent_bytes,
                    "{what}"
                );
                assert!(smaller.ephemeral_bytes <= larger.ephemeral_bytes, "{what}");
                assert!(peak(smaller) < peak(larger), "{what}");
                assert!(smaller.iteration_s <= larger.iteration_s, "{what}");
                assert!(smaller.compute_share <= larger.compute_share, "{what}");
            }
        }
    }

    #[test]
    fn shares_and_iteration_times_are_valid() {
        for workload in catalog() {
            let share = workload.compute_share;
            assert!(share > 0.0 && share <= 1.0, "{}", workload.name());
            assert!(
                workload.iteration_s.is_finite() && workload.iteration_s > 0.0,
                "{}",
                workload.name()
            );
        }
    }

    #[test]
    fn superres_128_is_small_in_memory_and_compute() {
        // Packing 300 of them gains 2.38x in the papers: each leaves most of the GPU idle.
        let superres = get("superres_128");
        assert!((0.35..=0.45).contains(&superres.compute_share));
        assert!(peak(superres) < 2 * GB);
    }

    #[test]
    fn resnet50_50_is_compute_bound() {
        // Packing gains only 1.07x in the papers: one job alone nearly saturates the GPU.
        let resnet = get("resnet50_50");
        assert!((0.90..=0.95).contains(&resnet.compute_share));
    }

    #[test]
    fn three_inception3_50_fit_together_at_their_peaks() {
        // The fair-sharing experiment runs three inception3_50 jobs at once.
        assert!(3 * peak(get("inception3_50")) <= REFERENCE_CAPACITY_BYTES);
    }

    #[test]
    fn deep_models_keep_far_less_persistent_than_ephemeral_memory() {
        // The papers' Observation 2. The fully connected alexnet and overfeat, and the tiny
        // vae, keep a large part of their peak resident, so it is checked on deep models.
        for name in ["inception3_50", "resnet50_50", "resnet152_75", "vgg16_100"] {
            let workload = get(name);
            assert!(
                4 * workload.persistent_bytes < workload.ephemeral_bytes,
                "{name}"
            );
        }
    }

    #[test]
    fn lookup_and_by_name_agree() {
        for workload in catalog() {
            assert_eq!(by_name(&workload.name()), Some(workload));
            assert_eq!(lookup(workload.model, workload.batch), Some(workload));
        }
        assert_eq!(get("googlenet_25").name(), "googlenet_25");
        assert_eq!(get("seq2seq_small").batch, "small");
        assert_eq!(by_name("googlenet_30"), None);
        assert_eq!(by_name("googlenet"), None);
        assert_eq!(by_name("lenet_25"), None);
        assert_eq!(by_name(""), None);
        assert_eq!(lookup("seq2seq", "Small"), None);
    }
}
