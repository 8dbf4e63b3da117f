"""The GPU catalogue: device-name matching and user overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import catalog


@pytest.mark.parametrize(
    "device, name",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ],
)
def test_torch_device_names_match(device: str, name: str) -> None:
    gpu = catalog.match_device(device)
    assert gpu is not None and gpu.name == name
    assert catalog.peak_flops_for(device) == gpu.peak_bf16_flops


def test_catalogue_names_match_too() -> None:
    assert catalog.match_device("A100-40GB").name == "A100-40GB"  # its alias regex alone would not say 40 vs 80
    assert catalog.match_device(" l4 ").name == "L4"


def test_unknown_device_has_no_peak() -> None:
    assert catalog.peak_flops_for("Tesla T4") is None
    assert catalog.peak_flops_for("cpu") is None


def test_builtin_entries_are_sane() -> None:
    gpus = catalog.load_catalog()
    assert len({g.name for g in gpus}) == len(gpus) >= 10
    h100 = catalog.find_gpu("h100-sxm", gpus)
    assert h100.peak_bf16_flops == pytest.approx(989e12)
    for g in gpus:
        assert g.memory_gib > 10 and g.peak_bf16_flops > 1e13 and g.on_demand_price > 0
        assert g.spot_price is None or 0 < g.spot_price < g.on_demand_price


def test_user_yaml_changes_a_price_and_adds_a_gpu(tmp_path: Path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "gpus:\n"
        "  - name: h100-sxm\n"  # case-insensitive: changes only the price
        "    on_demand_price: 1.99\n"
        "  - name: MyCard\n"
        "    memory_gib: 32\n"
        "    peak_bf16_flops: 2.0e14\n"
        "    on_demand_price: 0.5\n"
        "    aliases: ['mycard']\n"
    )
    gpus = catalog.load_catalog(path)
    builtin = catalog.find_gpu("H100-SXM")
    changed = catalog.find_gpu("H100-SXM", gpus)
    assert changed.on_demand_price == 1.99 and builtin.on_demand_price != 1.99
    assert changed.memory_gib == builtin.memory_gib and changed.spot_price == builtin.spot_price
    mine = catalog.find_gpu("MyCard", gpus)
    assert (mine.memory_gib, mine.peak_bf16_flops, mine.spot_price) == (32.0, 2.0e14, None)
    assert len(gpus) == len(catalog.load_catalog()) + 1
    assert catalog.peak_flops_for("Vendor MyCard 32GB", gpus) == 2.0e14
    # The built-in catalogue is untouched by the override (it is cached).
    assert catalog.find_gpu("H100-SXM").on_demand_price == builtin.on_demand_price


@pytest.mark.parametrize(
    "text, message",
    [
        ("gpus:\n  - name: New\n    memory_gib: 10\n", "needs peak_bf16_flops, on_demand_price"),
        ("gpus:\n  - name: L4\n    on_demand_prise: 1\n", "unknown key"),
        ("gpus:\n  - name: L4\n    on_demand_price: cheap\n", "must be a number"),
        ("gpus: 3\n", "expected `gpus:`"),
    ],
)
def test_bad_user_yaml_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text(text)
    with pytest.raises(catalog.CatalogError, match=message) as err:
        catalog.load_catalog(path)
    assert str(path) in str(err.value)
