// Package schema is the ent schema of the entinbox tests: invoices and
// their lines, in tables of their own names.
package schema

import (
	"entgo.io/ent"
	"entgo.io/ent/dialect/entsql"
	"entgo.io/ent/schema"
	"entgo.io/ent/schema/edge"
	"entgo.io/ent/schema/field"
)

// Invoice is the business row a handler writes, one per order.
type Invoice struct {
	ent.Schema
}

// Annotations names the table.
func (Invoice) Annotations() []schema.Annotation {
	return []schema.Annotation{entsql.Annotation{Table: "entinbox_invoices"}}
}

// Fields of the Invoice.
func (Invoice) Fields() []ent.Field {
	return []ent.Field{
		field.String("order_id").MaxLen(64).Unique(),
		field.Int("amount"),
	}
}

// Edges of the Invoice: its lines, whose foreign key is in their table.
func (Invoice) Edges() []ent.Edge {
	return []ent.Edge{edge.To("lines", Line.Type)}
}

// Line belongs to an Invoice.
type Line struct {
	ent.Schema
}

// Annotations names the table.
func (Line) Annotations() []schema.Annotation {
	return []schema.Annotation{entsql.Annotation{Table: "entinbox_lines"}}
}

// Fields of the Line.
func (Line) Fields() []ent.Field {
	return []ent.Field{field.String("sku").MaxLen(64)}
}

// Edges of the Line.
func (Line) Edges() []ent.Edge {
	return []ent.Edge{edge.From("invoice", Invoice.Type).Ref("lines").Unique()}
}
