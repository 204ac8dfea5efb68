"""stagewise: plan, edit, profile and export batched (vmap) execution of N copies of one PyTorch model.

The repository's folders are this package's subpackages once installed:
`from stagewise import planner, executor` (and `stagewise.app`, `stagewise.sample_models`).
Installed import names are unambiguous, so a project with its own `app` or `planner`
package can install stagewise next to it. A checkout runs through `pip install -e .`
(`make test` / `make run` do it), or without installing through `make test-gpu`'s path
link (a folder holding a `stagewise` symlink to the checkout, put on PYTHONPATH).
"""
