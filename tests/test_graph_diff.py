"""Golden graph diffs of the rewrite on a one-layer Llama (EXPECTTEST_ACCEPT=1 rewrites them)."""

import re

import expecttest
import torch

import kvpass
from tests.helpers import kv_heavy_llama


class GraphDiffTest(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch._dynamo.reset()
        model = kv_heavy_llama(layers=1)
        cls.backend = kvpass.kv4()
        model.compile(backend=cls.backend)
        # 3 new tokens: prefill, first decode (static length), decode with symbolic length
        model.generate(torch.arange(2, 12)[None], max_new_tokens=3, do_sample=False)

    def numbered_from_0(self, diff: str) -> str:
        """Graph names are numbered across the process: as if these were its first graphs."""
        first = int(self.backend.graphs[0].name.removeprefix("graph_"))
        return re.sub(r"graph_(\d+)", lambda m: f"graph_{int(m[1]) - first}", diff)

    def test_prefill_graph(self):
        self.assertExpectedInline(
            self.numbered_from_0(self.backend.graphs[0].diff),
            """\
--- graph_0 (fp16)
+++ graph_0 (kv4)
@@ -48,5 +48,3 @@
-    tensor = torch.tensor([], dtype = torch.float32, device = device(type='cpu'))
-    tensor_1 = torch.tensor([], dtype = torch.float32, device = device(type='cpu'))
-    keys = torch.cat([tensor, k_embed], dim = -2)
-    values = torch.cat([tensor_1, value_states], dim = -2)
-    attn_output = torch._C._nn.scaled_dot_product_attention(q_embed, keys, values, attn_mask = None, dropout_p = 0.0, scale = 0.125, is_causal = True, enable_gqa = True)
+    kv4_pack = kvpass_graph_ops_kv4_pack(k_embed, spec = 'int4:token:64:rot:mse:r64:s4:ctr:qs:dp:qr64', query = q_embed)
+    kv4_pack_1 = kvpass_graph_ops_kv4_pack(value_states, spec = 'int4:token:64:rot:mse:r64')
+    attn_output = torch._C._nn.scaled_dot_product_attention(q_embed, k_embed, value_states, attn_mask = None, dropout_p = 0.0, scale = 0.125, is_causal = True, enable_gqa = True)
@@ -84 +82 @@
-    return (values, keys, logits)
+    return (kv4_pack_1, kv4_pack, logits)
""",
        )

    def test_decode_graph(self):
        self.assertExpectedInline(
            self.numbered_from_0(self.backend.graphs[-1].diff),
            """\
--- graph_1 (fp16)
+++ graph_1 (kv4)
@@ -57,2 +56,0 @@
-    keys = torch.cat([cache_layers_0_keys, k_embed], dim = -2)
-    values = torch.cat([cache_layers_0_values, value_states], dim = -2)
@@ -61,2 +59,5 @@
-    attn_output = torch._C._nn.scaled_dot_product_attention(q_embed, keys, values, attn_mask = None, dropout_p = 0.0, scale = 0.125, is_causal = False, enable_gqa = True)
-    attn_output_1 = attn_output.reshape(1, -1, 1, 64)
+    kv4_decode = kvpass_graph_ops_kv4_decode(q_embed, cache_layers_0_keys, k_embed, cache_layers_0_values, value_states, attn_mask = None, scale = 0.125, is_causal = False, k_spec = 'int4:token:64:rot:mse:r64:s4:ctr:qs:dp:qr64', v_spec = 'int4:token:64:rot:mse:r64', query = q_embed)
+    kv4_decode_k = kv4_decode[1]
+    kv4_decode_v = kv4_decode[2]
+    kv4_decode_out = kv4_decode[0]
+    attn_output_1 = kv4_decode_out.reshape(1, -1, 1, 64)
@@ -93 +94 @@
-    return (values, keys, logits)
+    return (kv4_decode_v, kv4_decode_k, logits)
""",
        )

    def test_site_table(self):
        from kvpass.debug import site_table

        self.assertExpectedInline(
            "".join(site_table(g.sites) for g in self.backend.graphs),
            """\
site  module                    form  phase    kv cache  reason
0     model.layers.0.self_attn  sdpa  prefill  int4
site  module                    form  phase   kv cache  reason
0     model.layers.0.self_attn  sdpa  decode  int4
""",
        )
