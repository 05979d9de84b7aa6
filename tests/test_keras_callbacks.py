"""owt_tf.fit.callbacks: in a cluster only the chief writes the paths a user gave
Keras' file-writing callbacks; another worker writes its own scratch copy, and restores
from the chief's backup. (The 2-worker run: tests/test_keras_cluster.py.)"""
import os

import keras

from owt_tf.fit.callbacks import chief_path, chief_writes_files


def _callbacks(tmp_path):
    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / "training_metadata.json").write_text('{"epoch": 1, "batch": -1}')
    return [keras.callbacks.BackupAndRestore(str(backup), save_freq=3, delete_checkpoint=False),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "ck" / "e{epoch}.keras")),
            keras.callbacks.TensorBoard(str(tmp_path / "tb")),
            keras.callbacks.EarlyStopping()]


def test_the_chief_writes_where_the_user_said(tmp_path):
    given = _callbacks(tmp_path)
    with chief_writes_files(given, is_chief=True) as callbacks:
        assert callbacks is given


def test_another_worker_writes_its_own_scratch_copies(tmp_path):
    given = _callbacks(tmp_path)
    with chief_writes_files(given, is_chief=False) as callbacks:
        backup, checkpoint, board, stopping = callbacks
        scratch = os.path.dirname(backup.backup_dir)
        assert not scratch.startswith(str(tmp_path))
        # restores what the chief restores, saves as often, keeps what it was told to keep
        with open(os.path.join(backup.backup_dir, "training_metadata.json")) as f:
            assert f.read() == '{"epoch": 1, "batch": -1}'
        assert (backup.save_freq, backup.delete_checkpoint) == (3, False)
        assert checkpoint.filepath.startswith(scratch)
        assert checkpoint.filepath.endswith(os.path.join("ck", "e{epoch}.keras"))
        assert board.log_dir.startswith(scratch) and board.log_dir.endswith("tb")
        assert stopping is given[3]
        # the objects the user passed still name the shared paths
        assert given[1].filepath == str(tmp_path / "ck" / "e{epoch}.keras")
        assert given[2].log_dir == str(tmp_path / "tb")
    assert not os.path.exists(scratch)
    assert os.listdir(tmp_path / "backup") == ["training_metadata.json"]


def test_a_models_own_save_on_another_worker_goes_to_scratch(tmp_path):
    wanted = str(tmp_path / "model.weights.h5")
    with chief_path(wanted, is_chief=True) as path:
        assert path == wanted
    with chief_path(wanted, is_chief=False) as path:
        assert path != wanted and os.path.basename(path) == "model.weights.h5"
        open(path, "w").close()
    assert not os.path.exists(os.path.dirname(path)) and not os.path.exists(wanted)
