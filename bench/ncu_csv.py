"""Nsight Compute `--csv` reports: their metric rows and a row's device time (no MLX needed)."""
import csv


def ncu_rows(path: str):
    """The metric rows of an `ncu --csv` report (its log lines left out), as dicts by column."""
    return list(csv.DictReader(l for l in open(path) if l.startswith('"')))


def ncu_us(r) -> float:
    """A row's gpu__time_duration value in microseconds (ncu writes ns or us)."""
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0}[r["Metric Unit"]]
    return float(r["Metric Value"].replace(",", "")) * scale
