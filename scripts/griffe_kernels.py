"""A griffe extension for the API pages (mkdocs.yml): the repository's ``kernels/`` folder is the
installed package ``moefast.kernels`` (pyproject.toml's package-dir), which griffe, reading the
source tree, cannot find under ``moefast/``. It loads ``kernels`` and attaches it to ``moefast``, so
``moefast.kernels.*`` pages and the re-exports that import from it (``moefast.RoutingResult``)
resolve."""

import griffe


class KernelsInMoefast(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name == "moefast" and "kernels" not in pkg.members:
            pkg.set_member("kernels", loader.load("kernels"))
