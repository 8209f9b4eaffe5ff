"""Triton kernels for the hot paths of the decode loop, vendorable.

Each public function here has the same name and signature as an operation of
`spec.registry.OPERATIONS`, and imports only torch, triton and modules of this
package, so the folder can be copied into another engine's tree and checked
with `pytest --impl <its module name>`.

No kernel has landed yet: the conformance suite lists every operation as
missing and, with this package as the default implementation, runs those
tests as a self-check of the spec.
"""
