//! Rail affinity over a sysfs fixture tree this test writes: two NUMA nodes,
//! each with a PCIe switch holding a GPU and a NIC (node 0: a dual-function
//! adapter, mlx5_0 and mlx5_1; node 1: mlx5_2), plus a virtual rxe0 with no
//! PCI device. Checks what the verbs transport reports and does with it:
//! device order (PCI path), pciPath (realpath, NULL for rxe), NUMA node per
//! NIC and its CPUs, NIC identity for merging, and nearest NIC per GPU (the
//! doctor's answer).
use std::path::{Path, PathBuf};

use rustnet::for_tools::ib::device::{order_and_name, Candidate};
use rustnet::for_tools::ib::topo;

struct Tree(PathBuf);

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn w(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

fn pci_dev(root: &Path, path: &str, numa: i32, vendor: &str, class: &str) -> PathBuf {
    let p = root.join("devices").join(path);
    std::fs::create_dir_all(&p).unwrap();
    w(&p.join("numa_node"), &format!("{numa}\n"));
    w(&p.join("vendor"), &format!("{vendor}\n"));
    w(&p.join("class"), &format!("{class}\n"));
    let bus = root.join("bus/pci/devices");
    std::fs::create_dir_all(&bus).unwrap();
    std::os::unix::fs::symlink(&p, bus.join(p.file_name().unwrap())).unwrap();
    p
}

fn fixture() -> Tree {
    let root = std::env::temp_dir().join(format!("rustnet-topo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // node 0: root port 00:01.0 -> switch 01:00.0 -> downstream 02:00.0 (GPU) and 02:01.0 (NIC, two functions)
    let sw0 = "pci0000:00/0000:00:01.0/0000:01:00.0";
    let gpu0 = pci_dev(&root, &format!("{sw0}/0000:02:00.0/0000:03:00.0"), 0, "0x10de", "0x030200");
    let nic0 = pci_dev(&root, &format!("{sw0}/0000:02:01.0/0000:04:00.0"), 0, "0x15b3", "0x020700");
    let nic1 = pci_dev(&root, &format!("{sw0}/0000:02:01.0/0000:04:00.1"), 0, "0x15b3", "0x020700");
    // node 1: the same shape under pci0000:80
    let sw1 = "pci0000:80/0000:80:01.0/0000:81:00.0";
    let gpu1 = pci_dev(&root, &format!("{sw1}/0000:82:00.0/0000:83:00.0"), 1, "0x10de", "0x030200");
    let nic2 = pci_dev(&root, &format!("{sw1}/0000:82:01.0/0000:84:00.0"), 1, "0x15b3", "0x020700");
    // a NIC whose firmware reports no node
    let nic3 = pci_dev(&root, "pci0000:c0/0000:c0:01.0/0000:c1:00.0", -1, "0x15b3", "0x020700");
    for (dev, pci) in [("mlx5_1", &nic1), ("mlx5_2", &nic2), ("mlx5_0", &nic0), ("mlx5_3", &nic3)] {
        let d = root.join("class/infiniband").join(dev);
        std::fs::create_dir_all(&d).unwrap();
        std::os::unix::fs::symlink(pci, d.join("device")).unwrap();
    }
    // rxe0: a virtual device, no `device` link
    std::fs::create_dir_all(root.join("class/infiniband/rxe0/ports/1")).unwrap();
    w(&root.join("devices/system/node/node0/cpulist"), "0-3,8-11\n");
    w(&root.join("devices/system/node/node1/cpulist"), "4-7,12-15\n");
    let _ = (gpu0, gpu1);
    Tree(root)
}

#[test]
fn device_order_pci_path_numa_and_nearest_nic_over_two_numa_nodes() {
    let t = fixture();
    let sys = t.0.as_path();
    let real = |p: &str| std::fs::canonicalize(sys.join("devices").join(p)).unwrap().to_string_lossy().into_owned();

    // pciPath: the realpath of the device link; its last component is a bus id
    let p0 = topo::pci_path(sys, "mlx5_0").expect("mlx5_0 is a PCI device");
    assert_eq!(p0, real("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0"));
    assert!(p0.ends_with("/0000:04:00.0"));
    assert_eq!(topo::pci_path(sys, "rxe0"), None, "virtual devices report NULL");
    assert_eq!(topo::pci_path(sys, "nope"), None);

    // device order: PCI path, virtual devices last, whatever order discovery saw them in
    let cands: Vec<Candidate> = ["rxe0", "mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0"]
        .iter()
        .map(|d| Candidate { dev: d.to_string(), port: 1, pci: topo::pci_path(sys, d) })
        .collect();
    let order: Vec<String> = order_and_name(cands).into_iter().map(|(_, n)| n).collect();
    assert_eq!(order, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"]);

    // NUMA node per NIC, and that node's CPUs for the helper thread
    let numa: Vec<Option<i32>> = order.iter().map(|d| topo::numa_node(sys, d)).collect();
    assert_eq!(numa, [Some(0), Some(0), Some(1), None, None]);
    assert_eq!(topo::node_cpus(sys, 0).unwrap(), [0, 1, 2, 3, 8, 9, 10, 11]);
    assert_eq!(topo::node_cpus(sys, 1).unwrap(), [4, 5, 6, 7, 12, 13, 14, 15]);
    assert_eq!(topo::node_cpus(sys, 7), None);

    // the two functions of one adapter are one NIC (merge key); the others are not
    let key = |d: &str| topo::nic_key(&topo::pci_path(sys, d).unwrap());
    assert_eq!(key("mlx5_0"), key("mlx5_1"));
    assert_ne!(key("mlx5_0"), key("mlx5_2"));

    // nearest NIC per GPU (what the doctor prints): the NIC under the same switch
    let gpus = topo::gpus(sys);
    assert_eq!(gpus.len(), 2, "{gpus:?}");
    assert_eq!(gpus[0].1, Some(0));
    assert_eq!(gpus[1].1, Some(1));
    let nics: Vec<(String, String)> = order.iter().filter_map(|d| Some((d.clone(), topo::pci_path(sys, d)?))).collect();
    assert_eq!(topo::nearest_nic(&gpus[0].0, &nics).as_deref(), Some("mlx5_0"));
    assert_eq!(topo::nearest_nic(&gpus[1].0, &nics).as_deref(), Some("mlx5_2"));
    // with node 1's NIC gone, GPU1's nearest is whatever shares the most path (none below the root): the first
    let rest: Vec<(String, String)> = nics.iter().filter(|(n, _)| n != "mlx5_2").cloned().collect();
    assert_eq!(topo::nearest_nic(&gpus[1].0, &rest).as_deref(), Some("mlx5_0"));
    // the doctor answers with the same helper
    assert_eq!(topo::nearest_nic(&gpus[0].0, &nics).as_deref(), Some("mlx5_0"));
}

/// The helper thread's binding: pinning to the CPUs this process may use
/// works, pinning to none of them is refused with a reason.
#[test]
fn binding_a_thread_to_a_cpu_list() {
    let h = std::thread::spawn(|| {
        let ok = topo::bind_current_thread(&[0]).map_err(|e| e.to_string());
        let bad = topo::bind_current_thread(&[100_000]);
        (ok, bad)
    });
    let (ok, bad) = h.join().unwrap();
    // CPU 0 may be outside this process's set (a cpuset container): then the reason says so
    match ok {
        Ok(used) => assert_eq!(used, [0]),
        Err(e) => assert!(e.contains("not") || e.contains("sched_"), "{e}"),
    }
    assert!(bad.unwrap_err().contains("none of CPUs"));
}
