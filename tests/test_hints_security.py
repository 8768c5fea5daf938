"""Auth, tenant isolation and TLS of the hints server, over real gRPC."""

from __future__ import annotations

import datetime

import grpc
import pytest
from hints_support import ServerThread, batch, command, keys, signal, stub

from kvtier.hints._gen import hints_pb2 as pb
from kvtier.hints._gen import hints_pb2_grpc as pb_grpc
from kvtier.hints.server import TLSFiles, load_tokens

TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}


def _md(token: str | None = None, tenant: str | None = None) -> tuple:
    md = []
    if token is not None:
        md.append(("authorization", f"Bearer {token}"))
    if tenant is not None:
        md.append(("x-kvtier-tenant", tenant))
    return tuple(md)


@pytest.fixture(scope="module")
def authed():
    with ServerThread(tokens=TOKENS) as s:
        channel, st = stub(s.address)
        yield s, st
        channel.close()


@pytest.mark.parametrize("metadata", [(), _md("wrong"), (("authorization", "tok-alpha"),), _md("")])
def test_missing_or_wrong_token_is_unauthenticated(authed, metadata):
    s, st = authed
    for call, request in ((st.Publish, batch(signal("session_start", session_id="x"))),
                          (st.GetStats, pb.GetStatsRequest()),
                          (st.PublishStream, iter([batch(signal("session_start", session_id="y"))]))):
        with pytest.raises(grpc.RpcError) as info:
            call(request, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in info.value.details()
    assert s.call(lambda: s.server.graph.num_sessions) == 0  # nothing got through


def test_tenants_only_see_and_touch_their_own_sessions(authed):
    s, st = authed
    alpha, beta = _md("tok-alpha"), _md("tok-beta", tenant="alpha")  # beta cannot claim alpha by metadata
    st.Publish(batch(signal("session_start", session_id="shared-name"),
                     signal("agent_spawn", session_id="shared-name", agent_id="a")), metadata=alpha)
    # beta cannot read, extend or end alpha's session: to beta it does not exist.
    with pytest.raises(grpc.RpcError) as info:
        st.GetStats(pb.GetStatsRequest(session_id="shared-name"), metadata=beta)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for ev in (signal("agent_spawn", session_id="shared-name", agent_id="evil"),
               signal("session_end", session_id="shared-name"),
               signal("tool_call_start", session_id="shared-name", agent_id="a", tool_call_id="t", tool_name="x")):
        with pytest.raises(grpc.RpcError) as info:
            st.Publish(batch(ev), metadata=beta)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown session 'shared-name'" in info.value.details()
    # beta may use the same session id for its own, independent session.
    st.Publish(batch(signal("session_start", session_id="shared-name")), metadata=beta)
    a_stats = st.GetStats(pb.GetStatsRequest(session_id="shared-name"), metadata=alpha)
    b_stats = st.GetStats(pb.GetStatsRequest(session_id="shared-name"), metadata=beta)
    assert (a_stats.tenant, [a.agent_id for a in a_stats.session.agents]) == ("alpha", ["a"])
    assert (b_stats.tenant, list(b_stats.session.agents)) == ("beta", [])
    # event ids are per tenant: beta reusing alpha's id is not a duplicate.
    ev = signal("session_start", session_id="same-id")
    assert st.Publish(batch(ev), metadata=alpha).num_accepted == 1
    assert st.Publish(batch(ev), metadata=beta).num_accepted == 1


def test_a_tenant_can_neither_unpin_nor_evict_another_tenants_pinned_blocks():
    """Two tenants over one real store (``kvtier serve --store``): beta, knowing
    alpha's keys (e.g. from published KV events), cannot release alpha's pins,
    so filling the store evicts around them; beta's own pin is capped by its
    per-tenant budget; once alpha unpins, the blocks are evictable again."""
    torch = pytest.importorskip("torch")
    from kvtier.config import load_config
    from kvtier.hints.apply import HintLimits
    from kvtier.store import TieredStore

    cfg = load_config(env={}, overrides={"layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
                                         "tiers": {"hbm": {"enabled": False}, "dram": {"capacity_blocks": 4}},
                                         "put_tier": "dram", "pin_budget_blocks": 4})
    alpha, beta = _md("tok-alpha"), _md("tok-beta")
    with TieredStore(cfg) as store:
        zero = torch.zeros(store.layout.bytes_per_block, dtype=torch.uint8)
        ks = store.keys_for(list(range(8)))  # alpha's two blocks
        store.put(ks, [zero, zero])
        with ServerThread(tokens=TOKENS, store=store, limits=HintLimits(max_pinned_blocks_per_tenant=1)) as s:
            channel, st = stub(s.address)
            st.Publish(batch(signal("session_start", session_id="a")), metadata=alpha)
            st.Publish(batch(signal("session_start", session_id="b")), metadata=beta)
            st.Publish(batch(command("pin", session_id="a", block_keys=keys(ks[0]), ttl_s=60.0)), metadata=alpha)
            assert store.stats()["pinned_blocks"] == 1
            st.Publish(batch(command("unpin", session_id="b", block_keys=keys(ks[0])),
                             command("pin", session_id="b", block_keys=keys(*ks), ttl_s=60.0)), metadata=beta)
            assert store.stats()["pinned_blocks"] == 1  # alpha's pin stands; beta's 2-block pin is over its budget
            beta_outcomes = dict(st.GetStats(pb.GetStatsRequest(), metadata=beta).commands_by_outcome)
            assert beta_outcomes == {"unpin_not_owned": 1, "unpin_applied": 1, "pin_refused_tenant_budget": 1}
            for i in range(1, 6):  # beta's traffic fills the 4-block store over and over
                other = store.keys_for(list(range(100 * i, 100 * i + 8)))
                store.put(other, [zero, zero])
            assert store.contains_prefix(ks[:1]).num_blocks == 1  # pinned: survived
            st.Publish(batch(command("unpin", session_id="a", block_keys=keys(ks[0]))), metadata=alpha)
            assert store.stats()["pinned_blocks"] == 0
            for i in range(6, 9):
                store.put(store.keys_for(list(range(100 * i, 100 * i + 8))), [zero, zero])
            assert store.contains_prefix(ks[:1]).num_blocks == 0  # unpinned by its owner: evictable again
            channel.close()


def test_without_auth_the_tenant_comes_from_metadata():
    with ServerThread() as s:
        channel, st = stub(s.address)
        st.Publish(batch(signal("session_start", session_id="m")), metadata=_md(tenant="team-a"))
        assert st.GetStats(pb.GetStatsRequest(), metadata=_md(tenant="team-a")).num_sessions == 1
        assert st.GetStats(pb.GetStatsRequest()).tenant == "default"
        assert st.GetStats(pb.GetStatsRequest()).num_sessions == 0
        channel.close()


def test_token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# tenants\nalpha tok-a\n\nbare-token  # default tenant\n")
    assert load_tokens(str(path)) == {"tok-a": "alpha", "bare-token": "default"}
    path.write_text("a b c\n")
    with pytest.raises(ValueError, match="tokens:1"):
        load_tokens(str(path))


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem_cert = cert.public_bytes(serialization.Encoding.PEM)
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return pem_cert, pem_key


def test_tls_with_token():
    pytest.importorskip("cryptography")
    cert, key = _self_signed()
    with ServerThread(tokens=TOKENS, tls=TLSFiles(cert, key)) as s:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        with grpc.secure_channel(s.address, creds) as channel:
            st = pb_grpc.HintServiceStub(channel)
            resp = st.Publish(batch(signal("session_start", session_id="tls")), metadata=_md("tok-alpha"))
            assert resp.num_accepted == 1
            with pytest.raises(grpc.RpcError) as info:
                st.GetStats(pb.GetStatsRequest(), metadata=_md("nope"))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # a plaintext client cannot talk to the TLS port
        with grpc.insecure_channel(s.address) as plain:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.HintServiceStub(plain).GetStats(pb.GetStatsRequest(), metadata=_md("tok-alpha"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # the SDK speaks TLS too
        from kvtier.sdk import HintClient

        with HintClient(s.address, token="tok-beta", root_certificates=cert) as client:
            client.emit("session_start", session_id="sdk-tls")
            assert client.flush(10)
            assert client.stats().accepted == 1
