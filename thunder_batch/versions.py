"""Installed package versions, read from package metadata (imports nothing it reports on)."""

from __future__ import annotations

from importlib import metadata


def package_version(name: str, missing: str | None = None) -> str | None:
    """The installed version of distribution `name`, or `missing` when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return missing


def package_versions(names, missing: str | None = None) -> dict[str, str | None]:
    return {name: package_version(name, missing) for name in names}
